"""What a PD proxy costs: ucm-proxy vs vLLM's toy proxy vs the Rust vllm-router, side by side.

Instant fake vLLM backends (prefill and decode, 16-chunk streams) and wrk as the load generator.
For each target — (a) direct to the decode backend, (b) ucm-proxy in PD mode, (c) a faithful
re-implementation of vLLM's toy PD proxy (benchmarks/toy_pd_proxy.py), (d) vllm-router in its PD
mode — at concurrency 1, 16 and 64, streaming and not: requests/s, p50/p99 latency, and the proxy
process's CPU microseconds per request (its own CPU time from /proc).

Pinning (taskset): for throughput the proxy gets core 0 alone and wrk + backends share core 1,
so the proxy's cost is what is measured; at concurrency 1 everything runs on core 0 (waking an
idle core costs milliseconds here and would swamp the proxy's own latency).

``cpu_us_per_req_vs_vllm_router`` (streaming, c=64) comes from a paired phase after the table:
both proxies up, measured in alternating 2-second runs (4 rounds with ``--quick``, 10 without),
because one run per target drifts by ±20% on a shared machine.

    python benchmarks/proxy_overhead.py --quick --json OUT.json

``--smoke`` runs the same flow at its smallest (``make test``); its figures are not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ucm.deploy.ports import free_port, wait_for_port
from ucm_testing.processes import spawn_pinned as spawn
from ucm_testing.processes import stop_process

HERE = Path(__file__).resolve().parent
BODY = {"model": "fake-model", "prompt": "Hello, benchmark!", "max_tokens": 16}
CONCURRENCY = (1, 16, 64)
SMOKE_CONCURRENCY = (1, 64)  # the summary's two
PAIRED = ("ucm", "vllm-router")  # CPU per request compared in alternating runs


def pin(proc: subprocess.Popen[bytes], cores: str) -> None:
    subprocess.run(["taskset", "-a", "-p", "-c", cores, str(proc.pid)], check=True, capture_output=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and all its threads (and reaped children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def parse_wrk(text: str) -> dict[str, float]:
    def latency(pct: str) -> float:
        m = re.search(rf"^\s*{pct}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        return float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")

    requests = re.search(r"(\d+) requests in", text)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    socket_errors = re.search(r"Socket errors: (.*)", text)
    return {
        "requests": int(requests.group(1)) if requests else 0,
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),  # type: ignore[union-attr]
        "p50_ms": latency("50"),
        "p99_ms": latency("99"),
        "errors": (int(errors.group(1)) if errors else 0) + (1 if socket_errors else 0),
    }


class Target:
    def __init__(self, name: str, args: list[str] | None, port: int) -> None:
        self.name, self.args, self.port = name, args, port
        self.proc: subprocess.Popen[bytes] | None = None


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ucm-proxy-bench-"))
    duration = 1 if args.smoke else 3 if args.quick else 10
    concurrency = SMOKE_CONCURRENCY if args.smoke else CONCURRENCY
    lua = work / "post.lua"
    py = sys.executable
    fakes = {}
    for role in ("prefill", "decode"):
        port = free_port()
        fakes[role] = (
            spawn([py, "-m", "ucm_testing.fake_vllm", "--port", str(port), "--name", role], "1", work / f"{role}.log"),
            port,
        )
    prefill_url, decode_url = (f"http://127.0.0.1:{fakes[r][1]}" for r in ("prefill", "decode"))
    targets = [Target("direct", None, fakes["decode"][1])]
    p = free_port()
    targets.append(
        Target(
            "ucm",
            [
                py,
                "-m",
                "ucm_proxy",
                "--port",
                str(p),
                "--prefill",
                prefill_url,
                "--decode",
                decode_url,
                "--prefill-policy",
                "round_robin",
                "--decode-policy",
                "round_robin",
                # Every request through prefill, as the other proxies do (its prompt is short).
                "--min-prefill-tokens",
                "0",
            ],
            p,
        )
    )
    p = free_port()
    targets.append(
        Target(
            "toy",
            [py, str(HERE / "toy_pd_proxy.py"), "--port", str(p), "--prefill", prefill_url, "--decode", decode_url],
            p,
        )
    )
    router = shutil.which("vllm-router", path=str(Path(py).parent)) or shutil.which("vllm-router")
    if router:
        p = free_port()
        targets.append(
            Target(
                "vllm-router",
                [
                    router,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(p),
                    "--vllm-pd-disaggregation",
                    "--prefill",
                    prefill_url,
                    "--decode",
                    decode_url,
                    "--prefill-policy",
                    "round_robin",
                    "--decode-policy",
                    "round_robin",
                    "--log-level",
                    "error",
                ],
                p,
            )
        )
    rows: list[dict[str, Any]] = []
    paired: dict[str, Any] | None = None
    try:
        for _, port in fakes.values():
            if not wait_for_port("127.0.0.1", port, 30):
                raise RuntimeError("fake backend did not start")
        for target in targets:
            if target.args is not None:
                target.proc = spawn(target.args, "0", work / f"{target.name}.log")
                if not wait_for_port("127.0.0.1", target.port, 60):
                    raise RuntimeError(f"{target.name} did not start; see {work / (target.name + '.log')}")
                time.sleep(1.0)  # let background health checks settle
            for stream in (True, False):
                write_lua(lua, stream)
                for conc in concurrency:
                    rows.append(measure(target, fakes, lua, conc, stream, duration, warm_up=not args.smoke))
                    print(_row_text(rows[-1]), flush=True)
            if target.name not in PAIRED and target.proc is not None:
                stop_process(target.proc, group=True)
        pair = [t for t in targets if t.name in PAIRED]
        if len(pair) == len(PAIRED):
            write_lua(lua, True)
            rounds = 2 if args.smoke else 4 if args.quick else 10
            paired = paired_cpu(pair, fakes, lua, rounds, seconds=1 if args.smoke else 2)
    finally:
        for target in targets:
            if target.proc is not None and target.proc.poll() is None:
                stop_process(target.proc, group=True)
        for proc, _ in fakes.values():
            stop_process(proc, group=True)
        shutil.rmtree(work, ignore_errors=True)
    return summarize(rows, duration, paired)


def write_lua(lua: Path, stream: bool) -> None:
    lua.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [[{json.dumps({**BODY, 'stream': stream})}]]\n"
    )


def paired_cpu(pair: list[Target], fakes: dict, lua: Path, rounds: int, seconds: int = 2) -> dict[str, Any]:
    """CPU per streamed request at c=64, ucm-proxy and vllm-router measured in alternating short
    runs (the order swapped each round), so that the machine's drift (other tenants, frequency)
    falls on both alike; one run per target measures ±20% from one run to the next here."""
    cpu = {t.name: 0.0 for t in pair}
    requests = {t.name: 0 for t in pair}
    per_round = []
    for n in range(rounds):
        us = {}
        for target in pair if n % 2 == 0 else pair[::-1]:
            row = measure(target, fakes, lua, 64, True, seconds, warm_up=n == 0)
            cpu[target.name] += row["cpu_us_per_req"] * row["requests"]
            requests[target.name] += row["requests"]
            us[target.name] = row["cpu_us_per_req"]
        per_round.append(us["ucm"] / us["vllm-router"])
        print(f"paired round {n + 1}: " + "  ".join(f"{k} {v:.0f} us/req" for k, v in us.items()), flush=True)
    mean = {name: cpu[name] / requests[name] for name in cpu}
    return {
        "rounds": rounds,
        "seconds": seconds,
        "cpu_us_per_req": mean,
        "ratio": mean["ucm"] / mean["vllm-router"],
        "ratio_per_round": per_round,
    }


def measure(
    target: Target, fakes: dict, lua: Path, conc: int, stream: bool, duration: int, warm_up: bool = True
) -> dict[str, Any]:
    single_core = conc == 1
    backend_cores = "0" if single_core else "1"
    for proc, _ in fakes.values():
        pin(proc, backend_cores)
    if target.proc is not None:
        pin(target.proc, "0")
    path = "/v1/completions"
    url = f"http://127.0.0.1:{target.port}{path}"
    wrk = ["taskset", "-c", backend_cores, "wrk", "-t1", f"-c{conc}", "--latency", "-s", str(lua)]
    if warm_up:  # connections, caches
        subprocess.run([*wrk, "-d1s", url], capture_output=True, check=True)
    cpu0 = cpu_seconds(target.proc.pid) if target.proc is not None else 0.0
    out = subprocess.run([*wrk, f"-d{duration}s", url], capture_output=True, text=True, check=True).stdout
    cpu1 = cpu_seconds(target.proc.pid) if target.proc is not None else 0.0
    result = parse_wrk(out)
    us = (cpu1 - cpu0) * 1e6 / result["requests"] if target.proc is not None and result["requests"] else None
    return {"target": target.name, "concurrency": conc, "stream": stream, **result, "cpu_us_per_req": us}


def summarize(rows: list[dict[str, Any]], duration: int, paired: dict[str, Any] | None) -> dict[str, Any]:
    def get(target: str, conc: int, stream: bool) -> dict[str, Any] | None:
        return next(
            (r for r in rows if r["target"] == target and r["concurrency"] == conc and r["stream"] == stream), None
        )

    ours, toy, router = (get(t, 64, True) for t in ("ucm", "toy", "vllm-router"))
    ours1, router1, direct1 = (get(t, 1, True) for t in ("ucm", "vllm-router", "direct"))
    report: dict[str, Any] = {"duration_s": duration, "results": rows}
    if ours and toy:
        report["rps_vs_toy"] = ours["rps"] / toy["rps"]
    if ours:
        report["us_per_req"] = ours["cpu_us_per_req"]
    if ours and router:
        report["rps_vs_vllm_router"] = ours["rps"] / router["rps"]
    if paired is not None:
        # CPU per streamed request, ucm-proxy over vllm-router, at concurrency 64 (target <= 1.0).
        report["paired_cpu"] = paired
        report["cpu_us_per_req_vs_vllm_router"] = paired["ratio"]
    if ours1 and router1 and direct1:
        ours_added = ours1["p99_ms"] - direct1["p99_ms"]
        router_added = router1["p99_ms"] - direct1["p99_ms"]
        report["p99_added_ms"] = {"ucm": ours_added, "vllm-router": router_added}
        report["p99_added_vs_vllm_router"] = ours_added / router_added if router_added > 0 else None
        # p99 over a few seconds at concurrency 1 is a handful of samples: p50 is the steadier view.
        p50_ours, p50_router = ours1["p50_ms"] - direct1["p50_ms"], router1["p50_ms"] - direct1["p50_ms"]
        report["p50_added_vs_vllm_router"] = p50_ours / p50_router if p50_router > 0 else None
    return report


def _row_text(r: dict[str, Any]) -> str:
    us = f"{r['cpu_us_per_req']:.0f}" if r["cpu_us_per_req"] is not None else "-"
    return (
        f"{r['target']:<12} c={r['concurrency']:<3} {'stream' if r['stream'] else 'json  '}  "
        f"{r['rps']:>9.0f} req/s  p50 {r['p50_ms']:>7.2f} ms  p99 {r['p99_ms']:>7.2f} ms  "
        f"cpu {us:>6} us/req  errors {r['errors']}"
    )


def decider_cost(rounds: int = 2000) -> dict[str, float]:
    """CPU microseconds the proxy's selective disaggregation adds to a PD request (decide, then
    remember), by prompt: a ~4k-token text, the same as token ids, an 8-turn chat of ~4k tokens."""
    from ucm_proxy.decider import Decider

    text = " ".join(f"word{i:05d}" for i in range(1600))  # ~16k characters
    prompts = {
        "text_4k_tokens": ("/v1/completions", {"prompt": text}),
        "ids_4k_tokens": ("/v1/completions", {"prompt": list(range(4096))}),
        "chat_8_turns_4k_tokens": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": text[i * 2000 : (i + 1) * 2000]} for i in range(8)]},
        ),
    }
    out = {}
    for name, (route, body) in prompts.items():
        decider = Decider(256, 4.0, 200_000, 2.0)
        t0 = time.process_time()
        for _ in range(rounds):
            _, chunks = decider.decide(body, route)
            decider.remember(chunks)
        out[name] = round((time.process_time() - t0) / rounds * 1e6, 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 s per measurement")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the whole flow at its smallest (make test): 1 s per measurement, no warm-up, concurrency 1 and "
        "64, two paired rounds of 1 s; its figures measure nothing",
    )
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        print("needs wrk and taskset (apt-get install wrk util-linux)", file=sys.stderr)
        return 2
    report = run(args)
    report["decide_us"] = decider_cost()
    for key in (
        "rps_vs_toy",
        "rps_vs_vllm_router",
        "us_per_req",
        "cpu_us_per_req_vs_vllm_router",
        "p99_added_vs_vllm_router",
        "p50_added_vs_vllm_router",
    ):
        if key in report and report[key] is not None:
            print(f"{key:<30} {report[key]:.2f}")
    for name, us in report["decide_us"].items():
        print(f"decide_us {name:<18} {us:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
