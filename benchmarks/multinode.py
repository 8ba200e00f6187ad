"""A tensor-parallel engine over two processes against one process, on the same two cores.

The commands the operator renders for a pool's pods (``ucm_testing.engine_group``: a single-pod
engine, or a LeaderWorkerSet's leader and worker with vLLM's ``--nnodes 2`` on loopback), on the
generated bench model (hidden 1024, 8 layers, 16 heads / 8 KV heads, float32, 32 KiB of KV per
token), UCMConnector on a POSIX store, one engine at a time:

  tp1      one process, TP=1, both cores
  tp2x2    TP=2 over two processes (two "nodes"), one core each
  tp1s2    tp1 keeping each block as two shares (store_tp 2): what a TP=1 pool pays to share KV
           with a TP=2 pool (it writes and reads both shares of a block, one file each)

Per arm: TTFT of a cold --prompt-tokens prompt (max_tokens=1, median of --trials), TTFT of the same
prompts in a fresh engine that loads them from the store (warm), decode tokens/s of --rows
concurrent requests of --decode-tokens each, and the bytes one rank writes per block (its share's
file) against TP=1's whole block. The bound beside tp2x2 is tp1 itself: the same cores do the same
arithmetic, so a split whose communication and synchronisation cost nothing would match it; each
ratio (tp1 time / tp2x2 time, tp2x2 rate / tp1 rate) says how close the split comes. The bound
beside tp1s2 is tp1 too (the same bytes in one file per block).

    python benchmarks/multinode.py --json OUT.json      # ~5 min on 2 cores
    python benchmarks/multinode.py --smoke --json OUT.json   # make test's: the flow, not the figures
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ucm.deploy.demo_model import BENCH, TINY, ensure_model
from ucm.integration.vllm.config import kv_transfer_config
from ucm_testing.engine_group import EngineGroup
from ucm_testing.vllm_server import VLLMServer, cached_tokens

BLOCK = 32
IDLE_S = 1.5  # vLLM's workers busy-poll for a second after a request: let the engine go idle first
ARMS = {
    "tp1": {"tensor": 1, "nodes": 1, "cores": ["0-1"]},
    "tp2x2": {"tensor": 2, "nodes": 2, "cores": ["0", "1"]},
    "tp1s2": {"tensor": 1, "nodes": 1, "cores": ["0-1"], "store_tp": 2},
}


def first_token_s(engine: VLLMServer, prompt: list[int]) -> tuple[float, int]:
    time.sleep(IDLE_S)
    start = time.perf_counter()
    response = engine.complete(prompt, max_tokens=1)
    return time.perf_counter() - start, cached_tokens(response)


def decode_rate(engine: VLLMServer, prompts: list[list[int]], tokens: int) -> float:
    """Generated tokens per second of all rows decoding together (prompts already cached)."""
    time.sleep(IDLE_S)
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda p: engine.complete(p, max_tokens=tokens, ignore_eos=True), prompts))
    elapsed = time.perf_counter() - start
    return sum(r["usage"]["completion_tokens"] for r in done) / elapsed


def share_bytes(store: Path) -> dict[str, float]:
    """Mean file size per key suffix: the rank's share of a block (TP=1: the whole block)."""
    sizes: dict[str, list[int]] = {}
    for f in store.rglob("*"):
        if f.is_file() and not f.name.startswith("."):
            rank = f"rank{int.from_bytes(bytes.fromhex(f.name[64:]), 'little')}" if len(f.name) > 64 else "block"
            sizes.setdefault(rank, []).append(f.stat().st_size)
    return {rank: statistics.mean(s) for rank, s in sorted(sizes.items())}


def run_arm(name: str, arm: dict[str, Any], model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(11)  # the same prompts in every arm
    vocab = range(10, 500)
    prompts = [[rng.choice(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.trials)]
    rows = [[rng.choice(vocab) for _ in range(256)] for _ in range(args.rows)]
    store, logs = work / name / "kv", work / name / "logs"
    store.mkdir(parents=True)
    logs.mkdir()
    kv_config = work / name / "kv-transfer-config.json"
    split = {"store_tp": arm["store_tp"]} if "store_tp" in arm else {}
    kv_config.write_text(json.dumps(kv_transfer_config({"spec": "posix", "posix": {"roots": [str(store)]}}, **split)))
    model_spec = {"dtype": "float32", "blockSize": BLOCK, "maxModelLen": 4096}
    options = {"model_spec": model_spec, "tensor": arm["tensor"], "nodes": arm["nodes"], "cores": arm["cores"]}

    def engine(label: str) -> EngineGroup:
        return EngineGroup(model, kv_config, logs, label, kv_cache_gib=args.kv_cache_gib, **options)

    with engine("first") as leader:
        cold = [first_token_s(leader, p)[0] for p in prompts]
        for row in rows:
            leader.complete(row, max_tokens=1)
        rate = decode_rate(leader, rows, args.decode_tokens)
    with engine("second") as leader:  # a fresh prefix cache: the prompts come from the store
        warm, hits = zip(*(first_token_s(leader, p) for p in prompts), strict=True)
    return {
        "ttft_cold_s": statistics.median(cold),
        "ttft_warm_s": statistics.median(warm),
        "warm_hit_tokens": min(hits),
        "decode_tokens_per_s": rate,
        "bytes_per_share": share_bytes(store),
        "runs": {"ttft_cold_s": cold, "ttft_warm_s": list(warm)},
    }


def report(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    one, two, shares = arms["tp1"], arms["tp2x2"], arms["tp1s2"]
    block = one["bytes_per_share"]["block"]
    return {
        "arms": arms,
        "summary": {
            "ttft_cold_vs_tp1": one["ttft_cold_s"] / two["ttft_cold_s"],
            "ttft_warm_vs_tp1": one["ttft_warm_s"] / two["ttft_warm_s"],
            "decode_vs_tp1": two["decode_tokens_per_s"] / one["decode_tokens_per_s"],
            "split_ttft_cold_vs_tp1": one["ttft_cold_s"] / shares["ttft_cold_s"],
            "split_ttft_warm_vs_tp1": one["ttft_warm_s"] / shares["ttft_warm_s"],
            "block_bytes_tp1": block,
            "share_of_block_per_rank": {r: b / block for r, b in two["bytes_per_share"].items()},
        },
    }


def print_report(r: dict[str, Any]) -> None:
    print(f"{'arm':<8}{'TTFT cold s':>13}{'TTFT warm s':>13}{'warm hit':>10}{'decode tok/s':>14}  bytes per share")
    for name, a in r["arms"].items():
        shares = ", ".join(f"{k} {v:,.0f}" for k, v in a["bytes_per_share"].items())
        print(
            f"{name:<8}{a['ttft_cold_s']:>13.3f}{a['ttft_warm_s']:>13.3f}{a['warm_hit_tokens']:>10}"
            f"{a['decode_tokens_per_s']:>14.1f}  {shares}"
        )
    s = r["summary"]
    print(
        f"\ntp2x2 against its bound (tp1, the same cores): TTFT cold {s['ttft_cold_vs_tp1']:.2f}, "
        f"warm {s['ttft_warm_vs_tp1']:.2f}, decode {s['decode_vs_tp1']:.2f} (1.0 = a free split)"
    )
    print(
        f"tp1s2 (TP=1 keeping TP=2's shares) against tp1: TTFT cold {s['split_ttft_cold_vs_tp1']:.2f}, "
        f"warm {s['split_ttft_warm_vs_tp1']:.2f}"
    )
    shares = ", ".join(f"{k} {v:.3f}" for k, v in s["share_of_block_per_rank"].items())
    print(f"each rank writes of a TP=1 block ({s['block_bytes_tp1']:,.0f} bytes): {shares}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--dir", help="work directory's parent (default: the system's temporary directory)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every arm at its smallest (make test): the tiny demo model (2 KV heads: TP=2 splits them), "
        "1 trial of 256 tokens, 1 row of 4 decode tokens, the arms side by side (their engines start at "
        "once: mostly one core each importing Python); the flow, not the figures",
    )
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    if args.smoke:
        args.prompt_tokens, args.trials, args.rows, args.decode_tokens, args.kv_cache_gib = 256, 1, 1, 4, 1
    spec = TINY if args.smoke else BENCH
    model = ensure_model(spec)
    work = Path(tempfile.mkdtemp(prefix="ucm-multinode-", dir=args.dir))
    try:
        # Timed arms run alone on the cores; the smoke's figures mean nothing, so its arms overlap.
        with ThreadPoolExecutor(len(ARMS) if args.smoke else 1) as pool:
            runs = {name: pool.submit(run_arm, name, arm, model, work, args) for name, arm in ARMS.items()}
            arms = {name: run.result() for name, run in runs.items()}
    finally:
        for arm in ARMS:  # the stores (the logs stay)
            shutil.rmtree(work / arm / "kv", ignore_errors=True)
    result = report(arms)
    result["model"] = spec.name
    print_report(result)
    print(f"logs under {work}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
