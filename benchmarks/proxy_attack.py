"""The proxy under slow clients: a normal client's latency while hundreds of connections send a
request head slowly, or start an upload and stop.

ucm-proxy (a real process, its defaults, pinned to core 0) in front of an instant fake vLLM
backend; the clients run in this process on core 1. Phases, one run, each until every slow
connection has been answered (the proxy's own deadlines bound that):

  idle          the normal client alone
  slow_headers  200 connections: half grow one header 8 KiB each 50 ms, half go silent after a
                partial head
  slow_bodies   200 chunked uploads that send one chunk and stop
  both          the 400 at once

Each slow connection comes from an address of its own (127.0.1.x, 127.0.2.x: loopback is all of
127/8), so the per-client limits do not apply and the proxy's global ones must hold. Per phase: the
normal client's requests (one at a time, keep-alive), p50/p99 latency, ``p99_vs_idle`` (the bound is
1.0: an attack that costs nothing) over the requests served, the normal client's requests the proxy
refused (429: a budget the slow connections hold), the answers the slow connections got and when
the last came, and the proxy's peak RSS growth over idle next to its body budget
(``max_in_flight_bytes``).

    python benchmarks/proxy_attack.py --json OUT.json

``--quick`` (the smoke in ``make test``): 20 slow connections of each kind and shorter header and
body deadlines, so every phase ends in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from ucm.deploy.ports import free_port, wait_for_port
from ucm_proxy.config import ProxyConfig
from ucm_testing.processes import spawn_pinned, stop_process

BODY = {"model": "fake-model", "prompt": "Hello, benchmark!", "max_tokens": 16}
SLOW = 200  # slow-header connections, and slow-body ones
QUICK_SLOW = 20
QUICK_TIMEOUTS = {"header_s": 2.0, "body_s": 3.0}
Writer = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def growing(writer: asyncio.StreamWriter) -> None:
    writer.write(b"GET /health HTTP/1.1\r\nHost: proxy\r\nX-Grow: ")
    while True:
        await asyncio.sleep(0.05)
        writer.write(b"a" * 8192)


async def silent(writer: asyncio.StreamWriter) -> None:
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-")


async def idle_upload(writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
    )


async def slow_connection(send: Writer, address: str, port: int) -> tuple[str, float]:
    """The status line's code the proxy answered (or "closed"), and when."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))
    sender = asyncio.create_task(send(writer))
    try:
        line = await reader.readline()
        return (line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"), time.monotonic()
    except ConnectionError:
        return "reset", time.monotonic()
    finally:
        sender.cancel()
        writer.close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def phase(url: str, port: int, pid: int, attackers: list[Writer], minimum_s: float) -> dict[str, Any]:
    started = time.monotonic()
    base_rss = peak = rss_bytes(pid)
    slow = [
        asyncio.create_task(slow_connection(send, f"127.0.{1 + j // 250}.{j % 250 + 1}", port))
        for j, send in enumerate(attackers)
    ]
    latencies: list[float] = []
    refused: collections.Counter[int] = collections.Counter()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - started < minimum_s or not all(t.done() for t in slow):
            sent = time.monotonic()
            async with http.post(url + "/v1/completions", json=BODY) as r:
                await r.read()
            if r.status == 200:
                latencies.append(time.monotonic() - sent)
            else:
                refused[r.status] += 1
            peak = max(peak, rss_bytes(pid))
            await asyncio.sleep(0.01)
    answers = [t.result() for t in slow]
    latencies.sort()
    return {
        "normal_requests": len(latencies) + sum(refused.values()),
        "normal_refused": dict(refused),  # the normal client's requests the proxy did not serve
        "p50_ms": round(statistics.median(latencies) * 1e3, 2),
        "p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3, 2),
        "slow_answers": dict(collections.Counter(status for status, _ in answers)),
        "last_slow_answer_s": round(max((at for _, at in answers), default=started) - started, 2),
        "rss_growth_bytes": peak - base_rss,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle-s", type=float, default=10.0, help="how long the idle phase measures")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_SLOW} slow connections of each kind, a 2 s idle phase, the proxy's header and body "
        f"deadlines {QUICK_TIMEOUTS['header_s']:g} and {QUICK_TIMEOUTS['body_s']:g} s (a smoke, not a measurement)",
    )
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    slow = QUICK_SLOW if args.quick else SLOW
    idle_s = 2.0 if args.quick else args.idle_s
    work = Path(tempfile.mkdtemp(prefix="ucm-proxy-attack-"))
    py = sys.executable
    backend_port, port = free_port(), free_port()
    backend = spawn_pinned([py, "-m", "ucm_testing.fake_vllm", "--port", str(backend_port)], "1", work / "backend.log")
    command = [
        py,
        "-m",
        "ucm_proxy",
        "--port",
        str(port),
        "--mode",
        "mixed",
        "--decode",
        f"http://127.0.0.1:{backend_port}",
    ]
    if args.quick:
        (work / "proxy.json").write_text(json.dumps({"timeouts": QUICK_TIMEOUTS}))  # YAML reads JSON
        command += ["--config", str(work / "proxy.json")]
    proxy = spawn_pinned(command, "0", work / "proxy.log")
    try:
        wait_for_port("127.0.0.1", backend_port, 30)
        wait_for_port("127.0.0.1", port, 30)
        os.sched_setaffinity(0, {1})  # with the backend: the proxy has core 0 to itself
        url = f"http://127.0.0.1:{port}"
        headers: list[Writer] = [growing] * (slow // 2) + [silent] * (slow // 2)
        phases: dict[str, list[Writer]] = {
            "idle": [],
            "slow_headers": headers,
            "slow_bodies": [idle_upload] * slow,
            "both": headers + [idle_upload] * slow,
        }
        rows: dict[str, dict[str, Any]] = {}
        for name, attackers in phases.items():
            rows[name] = asyncio.run(phase(url, port, proxy.pid, attackers, 0.0 if attackers else idle_s))
            if name != "idle":
                rows[name]["p99_vs_idle"] = round(rows[name]["p99_ms"] / rows["idle"]["p99_ms"], 2)
            print(f"{name:>13}: {rows[name]}", flush=True)
    finally:
        stop_process(proxy)
        stop_process(backend)
    # its settings, as run above: its defaults, but for --quick's deadlines
    timeouts = QUICK_TIMEOUTS if args.quick else {}
    defaults = ProxyConfig(mode="mixed", decode=["http://127.0.0.1:1"], timeouts=timeouts)
    report = {
        "quick": args.quick,
        "phases": rows,
        "slow_connections": {"headers": slow, "bodies": slow},
        "max_in_flight_bytes": defaults.max_in_flight_bytes,
        "header_timeout_s": defaults.timeouts.header_s,
        "body_timeout_s": defaults.timeouts.body_s,
        "worst_p99_vs_idle": max(r["p99_vs_idle"] for n, r in rows.items() if n != "idle"),
        "normal_refused_share": max(
            sum(r["normal_refused"].values()) / max(1, r["normal_requests"]) for r in rows.values()
        ),
    }
    print(
        f"worst_p99_vs_idle {report['worst_p99_vs_idle']} (bound 1.0, target <= 2), "
        f"normal_refused_share {report['normal_refused_share']:.3f} (target 0)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
