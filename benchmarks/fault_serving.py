"""Serving while things break: the local PD stack (real vLLM engines, real store, real proxy)
under a steady stream of greedy requests while faults are injected one after the other:

  store_stalled            the POSIX store's mount stops answering (a FUSE passthrough, like an
                           NFS hard mount in an outage) for longer than the load deadline
  store_full               the same mount answers ENOSPC to every write
  store_write_hang         its writes (create, write, rename, setattr) stop answering, reads do not
  store_read_hang          its file reads stop answering, metadata and writes do not
  prefill_killed_mid_dump  SIGKILL of the prefill engine while requests are in flight
  decode_restarted         the decode engine stopped as a kubelet stops a pod (SIGTERM, SIGKILL
                           after the grace period); ``ucm up``'s supervisor starts it again
  mooncake_master_stopped  SIGSTOP of the Mooncake master (a second stack with Mooncake as the store)
  cache_write_back_hang    one engine (no PD) whose DRAM tier writes back to the mount, whose writes
                           stop answering: the tier must never freeze the engine

The hangs last ``--hang-s`` (default 75 s): long enough for the store breaker to mark the store
degraded and for ``/health`` to say so (``X-UCM-Store: degraded``). For them the table also says
when an engine first said so after the injection (``degraded s``) and when none did any more after
the mount recovered (``recovered s``).

Every answer is compared with a plain vLLM's greedy output for the same prompt (token by token);
prompts are kept only if every step's top-2 logprob margin is >= 0.1 on the plain engine, so a
different batch shape cannot flip a near-tie and pass for a wrong token. Clients (one request a
second each) retry 429, 502, 503 and 504 answers and refused connections, as an OpenAI client
does, for up to ``RETRY_FOR_S``; a request counts as completed when an attempt returns 200.

Per fault: the requests in flight between the injection and the recovery (each counted for the
first fault it met), how many completed, wrong tokens, p99 latency (first attempt to answer) and
the deadline that bounds it: the load deadline for a stalled store, the PD wait for dumps that
never land, the measured outage for a restart. ``none``: requests no fault touched.

    python benchmarks/fault_serving.py --quick --json OUT.json
    python benchmarks/fault_serving.py --smoke --only prefill_killed_mid_dump --skip-mooncake --json OUT.json

The second is make test's smoke: its environment has no FUSE client library (``make bench-deps``), so
only faults that need no stall mount are asked for (the posix stack's store is then a plain directory).

Needs root (or /dev/fuse access) and libfuse 3 with mfusepy (``make bench-deps``) for the store
mount (the store's faults and the write-back one); the Mooncake fault runs on the non-CUDA Mooncake
client that ``make dev`` installs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from ucm.deploy.demo_model import CORPUS, TINY, ensure_model
from ucm.deploy.local import LocalStack, Process, default_spec
from ucm.deploy.spec import UCMDeploymentSpec
from ucm.integration.vllm.config import ConnectorConfig, kv_transfer_config
from ucm.store.cache import CacheConfig
from ucm_testing.stallfs import StallMount, available
from ucm_testing.vllm_server import VLLMServer

MODEL = "tiny"
OUT_TOKENS = 12
MARGIN = 0.1
SMOKE_CANDIDATES = 200  # prompts tried on the plain engine; about a third have clear greedy answers
RETRY_FOR_S = 180.0
RETRYABLE = {429, 502, 503, 504}
PACE_S = 1.0  # each client sends at most one request a second
DEFAULTS = ConnectorConfig.model_validate({"store": {"spec": "empty"}})


def candidates(n: int, seed: int = 7) -> list[str]:
    """Distinct prompts of ~6-8 blocks from the demo corpus: each request loads blocks nobody cached."""
    sentences = [s for s in CORPUS.split("\n") if s.strip()]
    rng = random.Random(seed)
    return [" ".join(rng.choice(sentences) for _ in range(14)) + f" Note {k}:" for k in range(n)]


async def references(url: str, prompts: list[str]) -> dict[str, list[str]]:
    """Plain vLLM's greedy tokens for each prompt whose every step has a clear winner."""
    sem = asyncio.Semaphore(8)
    out: dict[str, list[str]] = {}

    async def one(http: aiohttp.ClientSession, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": OUT_TOKENS, "temperature": 0, "logprobs": 2}
        async with sem, http.post(url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            choice = (await r.json())["choices"][0]
        steps = choice["logprobs"]["top_logprobs"]
        margins = [sorted(s.values(), reverse=True) for s in steps]
        if len(steps) == OUT_TOKENS and all(len(m) > 1 and m[0] - m[1] >= MARGIN for m in margins):
            out[prompt] = choice["logprobs"]["tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        await asyncio.gather(*(one(http, p) for p in prompts))
    return out


@dataclass
class Outcome:
    prompt: str
    started: float
    ended: float = 0.0
    ok: bool = False
    attempts: int = 0
    tokens: list[str] = field(default_factory=list)
    error: str = ""
    trace: list[tuple[float, float, str]] = field(default_factory=list)  # each attempt: start, end, result


class Load:
    """A steady stream of requests through the proxy, ``concurrency`` at a time."""

    def __init__(self, url: str, prompts: list[str], concurrency: int) -> None:
        self.url, self.prompts, self.concurrency = url, prompts, concurrency
        self.outcomes: list[Outcome] = []
        self._next = 0
        self._stop = asyncio.Event()

    def _take(self) -> str:
        prompt = self.prompts[self._next % len(self.prompts)]  # past the pool: cached prompts
        self._next += 1
        return prompt

    async def _send(self, http: aiohttp.ClientSession, o: Outcome) -> None:
        body = {"model": MODEL, "prompt": o.prompt, "max_tokens": OUT_TOKENS, "temperature": 0, "logprobs": 0}
        while True:
            o.attempts += 1
            retry_after = 1.0
            sent = time.monotonic()
            try:
                async with http.post(self.url + "/completions", json=body) as r:
                    payload = await r.json(content_type=None)
                    o.trace.append((sent, time.monotonic(), str(r.status)))
                    if r.status == 200:
                        o.ok, o.tokens = True, payload["choices"][0]["logprobs"]["tokens"]
                        return
                    o.error = f"{r.status}: {(payload.get('error') or {}).get('message', payload)}"[:200]
                    if r.status not in RETRYABLE:
                        return
                    retry_after = float(r.headers.get("Retry-After", 1.0))
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                o.error = f"{type(exc).__name__}: {exc}"[:200]
                o.trace.append((sent, time.monotonic(), type(exc).__name__))
            if time.monotonic() + retry_after - o.started > RETRY_FOR_S:
                return
            await asyncio.sleep(retry_after)

    async def _worker(self, http: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            o = Outcome(self._take(), time.monotonic())
            self.outcomes.append(o)
            await self._send(http, o)
            o.ended = time.monotonic()
            # Paced: a fast (cached) answer does not turn into a flood that exhausts the prompts.
            await asyncio.sleep(max(0.0, o.started + PACE_S - o.ended))

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RETRY_FOR_S)) as http:
            await asyncio.gather(*(self._worker(http) for _ in range(self.concurrency)))

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Fault:
    name: str
    inject: Callable[[], None]
    clear: Callable[[], float | None]  # returns the outage (a restart) when that is the deadline
    hold_s: float
    deadline_s: float
    store_ok: Callable[[], bool] | None = None  # no engine's /health says its store is degraded


@dataclass
class Health:
    """When the engines said their store was degraded around a fault, in seconds."""

    degraded_after_s: float | None = None  # since the injection
    recovered_after_s: float | None = None  # since the fault was cleared

    async def watch(self, store_ok: Callable[[], bool], injected: float, cleared: asyncio.Event) -> None:
        cleared_at = None
        while True:
            ok = await asyncio.to_thread(store_ok)
            now = time.monotonic()
            if cleared.is_set() and cleared_at is None:
                cleared_at = now
            if not ok and self.degraded_after_s is None:
                self.degraded_after_s = round(now - injected, 1)
            if ok and cleared_at is not None:
                self.recovered_after_s = round(now - cleared_at, 1)
                return
            await asyncio.sleep(1.0)


@dataclass
class Window:
    fault: Fault
    start: float
    end: float
    deadline_s: float
    health: Health | None = None


def supervised(stack: LocalStack) -> threading.Event:
    """``ucm up``'s supervisor loop: restart roles that die. Set the event to stop it."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(0.5):
            stack.supervise(lambda m: print(f"  {m}", file=sys.stderr))

    threading.Thread(target=loop, daemon=True).start()
    return done


def role(stack: LocalStack, component: str) -> Process:
    return next(p for p in stack.processes if p.role.component == component)


def signal_role(stack: LocalStack, component: str, sig: signal.Signals) -> None:
    p = role(stack, component)
    assert p.popen is not None
    os.killpg(p.popen.pid, sig)


def back_after(stack: LocalStack, component: str, since: float, timeout: float = 300.0) -> float:
    """Seconds from ``since`` until the role, restarted by the supervisor, answers its probe."""
    p = role(stack, component)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.exited() is None and p.popen is not None and p.started_at > since and p.probe():
            return time.monotonic() - since
        time.sleep(0.5)
    raise RuntimeError(f"{component} did not come back within {timeout} s; see {p.log}")


POSIX_FAULTS = [
    "store_stalled",
    "store_full",
    "store_write_hang",
    "store_read_hang",
    "prefill_killed_mid_dump",
    "decode_restarted",
]
MOONCAKE_FAULTS = ["mooncake_master_stopped"]
WRITE_BACK_FAULTS = ["cache_write_back_hang"]
ALL_FAULTS = POSIX_FAULTS + MOONCAKE_FAULTS + WRITE_BACK_FAULTS
# Those that need the stall mount (FUSE: mfusepy and libfuse 3, `make bench-deps`); the others run
# on a plain store directory.
MOUNT_FAULTS = {"store_stalled", "store_full", "store_write_hang", "store_read_hang", "cache_write_back_hang"}


def stores_ok(stack: LocalStack) -> Callable[[], bool]:
    """True while no engine's /health says its store is degraded (X-UCM-Store)."""
    ports = [p.port for p in stack.processes if p.role.component in ("prefill", "decode")]

    def ok() -> bool:
        for port in ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.headers.get("X-UCM-Store", "").startswith("degraded"):
                        return False
            except OSError:
                pass  # down or warming up: not what is watched here
        return True

    return ok


def posix_faults(
    stack: LocalStack,
    mount: StallMount | None,
    load_s: float,
    pd_wait_s: float,
    save_wait_s: float,
    lookup_s: float,
    hang_s: float,
) -> list[Fault]:
    killed: dict[str, float] = {}

    def kill(component: str, sig: signal.Signals) -> Callable[[], None]:
        def inject() -> None:
            killed[component] = time.monotonic()
            signal_role(stack, component, sig)

        return inject

    def restart(component: str) -> Callable[[], None]:
        def inject() -> None:
            # Not a bare SIGTERM: vLLM can hang in its shutdown on a request that arrived during it
            # (seen: >2 min, its uvicorn "waiting for connections to close"); a kubelet, like
            # `ucm up`, kills it after the grace period.
            killed[component] = time.monotonic()
            threading.Thread(target=role(stack, component).stop, daemon=True).start()

        return inject

    def hang(name: str, only: str, deadline_s: float) -> Fault:
        assert mount is not None
        stall = functools.partial(mount.stall, only)
        return Fault(name, stall, mount.resume, hold_s=hang_s, deadline_s=deadline_s, store_ok=stores_ok(stack))

    def prefill_back() -> None:
        back_after(stack, "prefill", killed["prefill"])  # bounded by the PD wait, not by the outage

    store: list[Fault] = []
    if mount is not None:  # the store's faults need the stall mount under it
        store = [
            Fault("store_stalled", mount.stall, mount.resume, hold_s=load_s + 4, deadline_s=load_s),
            Fault("store_full", mount.fill, mount.make_room, hold_s=12, deadline_s=pd_wait_s),
            # A prefill waits up to the save wait for its blocks to land, then answers; its decode's
            # lookup of them (a stat in a directory where a create hangs) waits up to the lookup
            # deadline. Then the breaker skips the store and, once /health says so, decode serves alone.
            hang("store_write_hang", "writes", save_wait_s + lookup_s),
            hang("store_read_hang", "reads", load_s),
        ]
    return [
        *store,
        Fault("prefill_killed_mid_dump", kill("prefill", signal.SIGKILL), prefill_back, hold_s=0, deadline_s=pd_wait_s),
        Fault(
            "decode_restarted",
            restart("decode"),
            lambda: back_after(stack, "decode", killed["decode"]),
            hold_s=0,
            deadline_s=0,  # the measured outage
        ),
    ]


def mooncake_faults(stack: LocalStack, load_s: float) -> list[Fault]:
    return [
        Fault(
            "mooncake_master_stopped",
            lambda: signal_role(stack, "mooncake-master", signal.SIGSTOP),
            lambda: signal_role(stack, "mooncake-master", signal.SIGCONT),
            hold_s=load_s + 4,
            deadline_s=load_s,
        )
    ]


async def drive(url: str, prompts: list[str], faults: list[Fault], concurrency: int, gap_s: float):
    """Run the load against ``url`` (OpenAI's /v1); inject each fault after ``gap_s`` of steady
    traffic; stop the load once the last fault is over and let the requests in flight finish."""
    load = Load(url, prompts, concurrency)
    runner = asyncio.create_task(load.run())
    windows: list[Window] = []
    for fault in faults:
        await asyncio.sleep(gap_s)
        print(f"  injecting {fault.name}", file=sys.stderr)
        start = time.monotonic()
        await asyncio.to_thread(fault.inject)
        health, cleared = Health(), asyncio.Event()
        watcher = asyncio.create_task(health.watch(fault.store_ok, start, cleared)) if fault.store_ok else None
        await asyncio.sleep(fault.hold_s)
        outage = await asyncio.to_thread(fault.clear)
        cleared.set()
        await asyncio.sleep(gap_s)
        if watcher is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(watcher, timeout=60)
        windows.append(Window(fault, start, time.monotonic(), outage or fault.deadline_s, health if watcher else None))
    await asyncio.sleep(gap_s)
    load.stop()
    await runner
    return load.outcomes, windows


def wrong(got: list[str], want: list[str]) -> int:
    return sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(
    name: str, outcomes: list[Outcome], refs: dict[str, list[str]], deadline_s: float, health: Health | None = None
) -> dict[str, Any]:
    done = [o for o in outcomes if o.ok]
    errors = sorted({o.error for o in outcomes if not o.ok})
    return {
        "name": name,
        "requests": len(outcomes),
        "completed": len(done),
        "retried": sum(o.attempts > 1 for o in done),
        "wrong_tokens": sum(wrong(o.tokens, refs[o.prompt]) for o in done),
        "p50_latency_s": round(percentile([o.ended - o.started for o in done], 0.5), 3),
        "p99_latency_s": round(percentile([o.ended - o.started for o in done], 0.99), 3),
        "deadline_s": round(deadline_s, 2),
        **({} if health is None else vars(health)),
        "errors": errors[:5],
    }


def in_window(outcomes: list[Outcome], w: Window) -> list[Outcome]:
    """Requests in flight at some point of the window: one started before a fault and caught by it
    (retrying through a restart, say) is that fault's."""
    return [o for o in outcomes if o.started < w.end and o.ended > w.start]


def run_stack(
    spec: dict[str, Any],
    run_dir: Path,
    prompts: list[str],
    refs: dict[str, list[str]],
    concurrency: int,
    gap_s: float,
    make_faults: Callable[[LocalStack], list[Fault]],
    mount: StallMount | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if mount is not None:
        mount.start()
    stack = LocalStack(UCMDeploymentSpec.model_validate(spec), run_dir)
    try:
        stack.start(lambda message, waiting: print(f"  {message}", file=sys.stderr) if message else None)
        stop_supervising = supervised(stack)
        try:
            outcomes, windows = asyncio.run(drive(stack.base_url, prompts, make_faults(stack), concurrency, gap_s))
        finally:
            stop_supervising.set()
    finally:
        stack.stop()
        if mount is not None:
            mount.stop()
    return fault_rows(run_dir, outcomes, windows, refs)


def run_write_back(
    model: Path,
    run_dir: Path,
    prompts: list[str],
    refs: dict[str, list[str]],
    concurrency: int,
    gap_s: float,
    hang_s: float,
) -> list[dict[str, Any]]:
    """One engine (no PD) whose DRAM tier writes back to the stall mount: a dump is done once in
    memory, and the tier bounds how long one waits for room among the writes still pending."""
    mount = StallMount(run_dir / "backing", run_dir / "kv", run_dir / "flags", run_dir / "stallfs.log").start()
    cache = {"capacity": "256MiB", "write_mode": "back", "write_back_max_pending": "4MiB"}
    store = {"spec": "cache|posix", "cache": cache, "posix": {"roots": [str(mount.mountpoint)]}}
    timeout_s = CacheConfig.model_validate(cache).write_back_timeout_s
    server = VLLMServer(
        model,
        run_dir / "engine.log",
        kv_transfer_config=kv_transfer_config(store, "kv_both"),
        extra_args=["--served-model-name", MODEL],
    )
    fault = Fault("cache_write_back_hang", lambda: mount.stall("writes"), mount.resume, hang_s, timeout_s)
    try:
        server.start().wait_ready()
        outcomes, windows = asyncio.run(drive(server.url + "/v1", prompts, [fault], concurrency, gap_s))
    finally:
        server.stop()
        mount.stop()
    rows, _ = fault_rows(run_dir, outcomes, windows, refs)
    return rows


def fault_rows(
    run_dir: Path, outcomes: list[Outcome], windows: list[Window], refs: dict[str, list[str]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A row per fault (the requests it caught) and one of the requests no fault touched."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_timeline(run_dir / "timeline.json", outcomes, windows)
    rows, counted = [], set()
    for w in windows:
        caught = [o for o in in_window(outcomes, w) if id(o) not in counted]  # the first fault it met
        counted |= {id(o) for o in caught}
        rows.append(summarize(w.fault.name, caught, refs, w.deadline_s, w.health))
    return rows, summarize("none", [o for o in outcomes if id(o) not in counted], refs, 0.0)


def shown(seconds: float | None) -> str:
    return "-" if seconds is None else str(seconds)


def write_timeline(path: Path, outcomes: list[Outcome], windows: list[Window]) -> None:
    """Every request's attempts and every fault's window, in seconds from the first request: where
    a latency came from (kept with the logs by --run-dir)."""
    t0 = min((o.started for o in outcomes), default=0.0)
    at = lambda t: round(t - t0, 3)  # noqa: E731
    timeline = {
        "faults": [{"name": w.fault.name, "start": at(w.start), "end": at(w.end)} for w in windows],
        "requests": [
            {
                "started": at(o.started),
                "ended": at(o.ended),
                "ok": o.ok,
                "attempts": [[at(s), at(e), r] for s, e, r in o.trace],
            }
            for o in outcomes
        ],
    }
    path.write_text(json.dumps(timeline, indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 requests at a time, 4 s of steady traffic between faults")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--gap-s", type=float, default=8.0, help="steady traffic before and after each fault")
    p.add_argument("--skip-mooncake", action="store_true", help="without the Mooncake stack")
    p.add_argument("--only", help=f"comma-separated faults to inject (of {', '.join(ALL_FAULTS)})")
    p.add_argument("--hang-s", type=float, default=75.0, help="how long the store hangs stay")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--run-dir", help="keep the stacks' logs here (default: a temporary directory)")
    p.add_argument(
        "--reference-url",
        help=f"a running plain vLLM serving the tiny model as {MODEL!r}: the reference answers come from it "
        "(default: a plain engine of our own, started before the stack and stopped after the references)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the flow at its smallest (make test): 1 request at a time, 2 s of steady traffic between faults, "
        f"{SMOKE_CANDIDATES} candidate prompts; with --only, the faults make test can run",
    )
    args = p.parse_args()
    concurrency, gap_s = (1, 2.0) if args.smoke else (2, 4.0) if args.quick else (args.concurrency, args.gap_s)
    only = set(args.only.split(",")) if args.only else set(ALL_FAULTS)
    if unknown := only - set(ALL_FAULTS):
        p.error(f"--only: unknown faults {sorted(unknown)}")
    mounted = bool(only & MOUNT_FAULTS)
    why = available() if mounted else None
    if why is not None:
        print(f"fault_serving: {why} (the store's faults need it: --only others runs without)", file=sys.stderr)
        return 2
    model = ensure_model(TINY)
    load_s, pd_wait_s = float(DEFAULTS.load_timeout_s or 0), DEFAULTS.pd_wait_timeout_s
    save_wait_s, lookup_s = DEFAULTS.pd_save_wait_s, DEFAULTS.lookup_timeout_s

    with contextlib.ExitStack() as cleanup:
        run = Path(args.run_dir) if args.run_dir else Path(cleanup.enter_context(tempfile.TemporaryDirectory()))
        run.mkdir(parents=True, exist_ok=True)
        wanted = candidates(SMOKE_CANDIDATES if args.smoke else 1500 if args.quick else 3000)
        if args.reference_url:
            refs = asyncio.run(references(args.reference_url, wanted))
        else:
            plain = VLLMServer(model, run / "plain.log", extra_args=["--served-model-name", MODEL]).start()
            try:
                refs = asyncio.run(references(plain.wait_ready().url, wanted))
            finally:
                plain.stop()
        prompts = list(refs)
        print(f"  {len(prompts)} prompts with clear greedy answers", file=sys.stderr)

        mount = (
            StallMount(run / "backing", run / "posix" / "kv", run / "flags", run / "stallfs.log") if mounted else None
        )
        faults, baseline = run_stack(
            default_spec(model),
            run / "posix",
            prompts,
            refs,
            concurrency,
            gap_s,
            lambda stack: [
                f
                for f in posix_faults(stack, mount, load_s, pd_wait_s, save_wait_s, lookup_s, args.hang_s)
                if f.name in only
            ],
            mount,
        )
        if not args.skip_mooncake and only & set(MOONCAKE_FAULTS):
            spec = default_spec(model)
            spec["store"] = {"type": "mooncake", "mooncake": {"master": {}, "segmentSize": "256Mi"}}
            more, _ = run_stack(
                spec, run / "mooncake", prompts, refs, concurrency, gap_s, lambda s: mooncake_faults(s, load_s)
            )
            faults += more
        if only & set(WRITE_BACK_FAULTS):
            faults += run_write_back(model, run / "write-back", prompts, refs, concurrency, gap_s, args.hang_s)

    total = sum(f["requests"] for f in faults)
    result = {
        "concurrency": concurrency,
        "output_tokens": OUT_TOKENS,
        "baseline": baseline,
        "faults": faults,
        "completed_fraction": round(sum(f["completed"] for f in faults) / total, 4) if total else 0.0,
        "wrong_tokens": sum(f["wrong_tokens"] for f in faults),
        "max_p99_over_deadline_s": round(max(f["p99_latency_s"] - f["deadline_s"] for f in faults), 3),
    }
    print(
        f"{'fault':26}{'requests':>9}{'done':>6}{'retried':>8}{'wrong':>6}{'p50 s':>8}{'p99 s':>8}{'deadline':>9}"
        f"{'degraded s':>11}{'recovered s':>12}"
    )
    for f in [baseline, *faults]:
        print(
            f"{f['name']:26}{f['requests']:>9}{f['completed']:>6}{f['retried']:>8}{f['wrong_tokens']:>6}"
            f"{f['p50_latency_s']:>8}{f['p99_latency_s']:>8}{f['deadline_s']:>9}"
            f"{shown(f.get('degraded_after_s')):>11}{shown(f.get('recovered_after_s')):>12}"
        )
        for e in f["errors"]:
            print(f"{'':28}{e}")
    print(
        f"completed_fraction {result['completed_fraction']}  wrong_tokens {result['wrong_tokens']}  "
        f"max_p99_over_deadline_s {result['max_p99_over_deadline_s']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
