"""What vLLM's spinning queue readers cost a CPU engine, against UCM's CPU wait (``cpu_wait``).

Two arms, the same plain engine (the tiny model, both cores), one at a time:

  vllm   vLLM alone (``VLLM_PLUGINS`` names no plugin): readers spin 1 s after each message
  ucm    UCM's plugin installed (``ucm.integration.vllm.cpu_wait``): readers sleep at once and
         every write wakes them

Per arm:

- ``paced``: one client, a short request (8 tokens) every --gap-s for --duration-s: the CPU seconds
  the engine's processes used per request and the median latency. Beside it, ``back_to_back``: the
  same requests sent without a gap, where no reader waits long between messages. It is a
  reference, not a strict bound: the vLLM arm's readers spin between back-to-back steps too, and
  the client's own CPU competes with the engine's. No wait can cost less than nothing, so the ucm
  arm's paced CPU over its back-to-back CPU says how much its waits still cost.
- ``decode``: tokens/s of one request of 256 tokens, and of 8 concurrent requests of 128.

    python benchmarks/cpu_wait.py --json OUT.json      # ~3 min on 2 cores
    python benchmarks/cpu_wait.py --smoke --json OUT.json   # make test's: the flow, not the figures
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ucm.deploy.demo_model import TINY, ensure_model
from ucm_testing.timing import tree_cpu_s
from ucm_testing.vllm_server import VLLMServer

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def engine_cpu_s(server: VLLMServer) -> float:
    """CPU seconds used so far by the engine's processes (API server, engine core, workers)."""
    assert server.pid is not None
    return tree_cpu_s(server.pid)


def requests(server: VLLMServer, duration_s: float, gap_s: float) -> dict[str, float]:
    """Short requests for ``duration_s``, ``gap_s`` apart: CPU per request, median latency."""
    cpu0, start = engine_cpu_s(server), time.monotonic()
    latencies = []
    while time.monotonic() - start < duration_s:
        sent = time.monotonic()
        server.complete(PROMPT, max_tokens=8)
        latencies.append(time.monotonic() - sent)
        time.sleep(gap_s)
    time.sleep(gap_s)  # the last request's idle wait counts, as every other's does
    cpu = engine_cpu_s(server) - cpu0
    return {
        "requests": len(latencies),
        "cpu_s_per_request": cpu / len(latencies),
        "latency_ms_p50": statistics.median(latencies) * 1000,
    }


def decode(server: VLLMServer, tokens: int) -> dict[str, float]:
    started = time.monotonic()
    server.complete(PROMPT, max_tokens=tokens, ignore_eos=True)
    single = tokens / (time.monotonic() - started)
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: server.complete(f"{i}: {PROMPT}", max_tokens=tokens // 2, ignore_eos=True), range(8)))
    return {"single_tok_s": single, "batch8_tok_s": 8 * (tokens // 2) / (time.monotonic() - started)}


def run_arm(arm: str, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    server = VLLMServer(ensure_model(TINY), logs / f"{arm}.log")
    if arm == "vllm":
        server.env["VLLM_PLUGINS"] = ""  # a list naming no plugin: vLLM alone
    server.start()
    try:
        server.wait_ready()
        server.complete(PROMPT, max_tokens=8)  # warm-up
        return {
            "paced": requests(server, args.duration_s, args.gap_s),
            "back_to_back": requests(server, args.duration_s / 2, 0.0),
            "decode": decode(server, args.decode_tokens),
        }
    finally:
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=30.0, help="paced requests for this long per arm")
    p.add_argument("--gap-s", type=float, default=0.5, help="between paced requests")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--smoke", action="store_true", help="seconds per phase, not figures")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.smoke:
        args.duration_s, args.decode_tokens = 2.0, 16

    with tempfile.TemporaryDirectory() as tmp:
        arms = {arm: run_arm(arm, Path(tmp), args) for arm in ("vllm", "ucm")}

    header = ["paced CPU-s/req", "b2b", "paced p50 ms", "b2b", "tok/s 1", "tok/s 8"]
    print(f"{'arm':<6} " + " ".join(f"{h:>{max(7, len(h))}}" for h in header))
    for arm, r in arms.items():
        paced, b2b, dec = r["paced"], r["back_to_back"], r["decode"]
        print(
            f"{arm:<6} {paced['cpu_s_per_request']:>15.3f} {b2b['cpu_s_per_request']:>7.3f} "
            f"{paced['latency_ms_p50']:>12.1f} {b2b['latency_ms_p50']:>7.1f} "
            f"{dec['single_tok_s']:>7.1f} {dec['batch8_tok_s']:>7.1f}"
        )
    vllm, ucm = arms["vllm"], arms["ucm"]
    summary = {
        "paced_cpu_per_request_ucm_vs_vllm": ucm["paced"]["cpu_s_per_request"] / vllm["paced"]["cpu_s_per_request"],
        "paced_cpu_per_request_ucm_vs_back_to_back": ucm["paced"]["cpu_s_per_request"]
        / ucm["back_to_back"]["cpu_s_per_request"],
        "paced_latency_ucm_vs_vllm": ucm["paced"]["latency_ms_p50"] / vllm["paced"]["latency_ms_p50"],
        "decode_single_ucm_vs_vllm": ucm["decode"]["single_tok_s"] / vllm["decode"]["single_tok_s"],
        "decode_batch8_ucm_vs_vllm": ucm["decode"]["batch8_tok_s"] / vllm["decode"]["batch8_tok_s"],
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "arms": arms, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
