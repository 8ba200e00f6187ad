"""Rolling engine pools under load on the local stack: does a rollout drop, cut or corrupt anything?

The stack is ``ucm up``'s (``LocalStack``); the rollouts are ``ucm restart``'s code path
(``LocalStack.roll``: a new engine joins the proxy's pools before the old one leaves and drains).
Phases, one after another, each while a steady stream of requests runs (``--concurrency`` clients,
streamed and whole answers alternating, every third one long):

- ``decode``: roll the decode pool;
- ``prefill``: roll the prefill pool;
- ``both_changed``: a changed spec (``store.hashing.salt``: every block id and the engines'
  pairing identity change, the model's answers do not) rolls both pools, as ``ucm restart -f``.

Per phase, over the requests that started in it: ``failed`` (not 200, a connection error, or an
error event in a stream), ``truncated_streams`` (a stream that ended without a finish reason or
``[DONE]``), ``wrong`` (an answer that differs from the one before any rollout, greedy decoding,
over the 32 steps where the demo prompts' every token has a clear winner: ``ucm_testing.prompts``),
``mismatched_pairs`` (the proxy's ``ucm_proxy_pd_pairs_total{matched="false"}``: a prefill's KV
sent to a decode that cannot use it). Targets: failed = 0 and truncated_streams = 0.

    python benchmarks/rollout_serving.py --quick --json OUT.json
    python benchmarks/rollout_serving.py --quick --phases decode --json OUT.json   # make test's smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from ucm.deploy.demo_model import TINY, ensure_model
from ucm.deploy.local import LocalStack, default_spec
from ucm.deploy.spec import UCMDeploymentSpec
from ucm_testing.prompts import PROMPTS

MODEL = "tiny"
SHORT, LONG = 16, 160
CHECKED = 32  # steps whose greedy token has a top-2 margin >= 0.1 for every demo prompt
PHASES = ("decode", "prefill", "both_changed")


@dataclass
class Outcome:
    prompt: int
    stream: bool
    started: float
    ended: float = 0.0
    result: str = "ok"  # ok, failed, truncated
    text: str = ""
    error: str = ""


def body(prompt: str, n: int, stream: bool) -> dict[str, Any]:
    tokens = LONG if n % 3 == 2 else SHORT
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def one(http: aiohttp.ClientSession, url: str, o: Outcome, request: dict[str, Any]) -> None:
    try:
        async with http.post(url + "/completions", json=request) as r:
            if r.status != 200:
                o.result, o.error = "failed", f"{r.status}: {(await r.text())[:200]}"
                return
            if not request["stream"]:
                o.text = (await r.json())["choices"][0]["text"]
                return
            finished = done = False
            async for raw in r.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        o.result, o.error = "failed", str(chunk["error"])[:200]
                        return
                    choice = chunk["choices"][0]
                    o.text += choice.get("text") or ""
                    finished = finished or choice.get("finish_reason") is not None
            if not (finished and done):
                o.result, o.error = "truncated", f"finish_reason seen: {finished}, [DONE] seen: {done}"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        o.result, o.error = "failed", f"{type(exc).__name__}: {exc}"[:200]


class Load:
    """``concurrency`` clients sending one request after another until stopped (a thread of its own)."""

    def __init__(self, url: str, prompts: list[str], concurrency: int) -> None:
        self.url, self.prompts, self.concurrency = url, prompts, concurrency
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._count = 0

    async def _client(self, http: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            n = self._count
            self._count += 1
            i = n % len(self.prompts)
            o = Outcome(i, stream=n % 2 == 1, started=time.monotonic())
            self.outcomes.append(o)
            await one(http, self.url, o, body(self.prompts[i], i, o.stream))
            o.ended = time.monotonic()

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            await asyncio.gather(*(self._client(http) for _ in range(self.concurrency)))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(700)


async def references(url: str, prompts: list[str]) -> list[str]:
    """Each prompt's first CHECKED greedy tokens, before any rollout."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        out = []
        for i, prompt in enumerate(prompts):
            o = Outcome(i, False, time.monotonic())
            await one(http, url, o, {**body(prompt, i, False), "max_tokens": CHECKED})
            assert o.result == "ok", o.error
            out.append(o.text)
        return out


def wrong(o: Outcome, reference: str) -> bool:
    """A short answer must be where the reference starts, a long one must start with it."""
    return o.result == "ok" and not (reference.startswith(o.text) or o.text.startswith(reference))


def mismatched_pairs(stack: LocalStack) -> float:
    """The proxy's count of PD requests whose decode did not share the prefill's pairing identity."""
    series = 'ucm_proxy_pd_pairs_total{matched="false"} '
    with urllib.request.urlopen(stack.base_url.removesuffix("/v1") + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return next((float(line.split()[1]) for line in lines if line.startswith(series)), 0.0)


def summarize(name: str, outcomes: list[Outcome], refs: list[str], pairs: float, seconds: float) -> dict[str, Any]:
    failed = [o for o in outcomes if o.result == "failed"]
    return {
        "name": name,
        "seconds": round(seconds, 1),
        "requests": len(outcomes),
        "streams": sum(o.stream for o in outcomes),
        "failed": len(failed),
        "truncated_streams": sum(o.result == "truncated" for o in outcomes),
        "wrong": sum(wrong(o, refs[o.prompt]) for o in outcomes),
        "mismatched_pairs": int(pairs),
        "errors": sorted({o.error for o in failed})[:5],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 clients, 6 prompts (else 4 clients, 9 prompts)")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--run-dir", type=Path, help="keep the stack's files and logs here")
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"which rollouts, in this order, of {', '.join(PHASES)} (make test's smoke: decode; "
        "e2e/test_day_two.py rolls both pools under load)",
    )
    args = parser.parse_args()
    chosen = [p for p in args.phases.split(",") if p]
    if unknown := set(chosen) - set(PHASES):
        parser.error(f"--phases: {', '.join(sorted(unknown))} unknown; choose from {', '.join(PHASES)}")
    concurrency = args.concurrency or (2 if args.quick else 4)
    prompts = list(PROMPTS[: 6 if args.quick else 9])
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="ucm-rollout-"))
    spec = default_spec(ensure_model(TINY))
    stack = LocalStack(UCMDeploymentSpec.model_validate(spec), run_dir)

    def progress(message: str, _waiting: list[Any]) -> None:
        if message:
            print(f"  {message}", file=sys.stderr, flush=True)

    changed = {**spec, "store": {**spec["store"], "hashing": {"salt": "rollout-2"}}}
    rolls: dict[str, Callable[[], None]] = {
        "decode": lambda: stack.roll(["decode"], progress),
        "prefill": lambda: stack.roll(["prefill"], progress),
        "both_changed": lambda: stack.roll(stack.reconfigure(UCMDeploymentSpec.model_validate(changed)), progress),
    }
    phases = [(name, rolls[name]) for name in chosen]
    results = []
    try:
        stack.start(progress)
        refs = asyncio.run(references(stack.base_url, prompts))
        with Load(stack.base_url, prompts, concurrency) as load:
            for name, roll in phases:
                print(f"phase {name}", file=sys.stderr, flush=True)
                pairs, started = mismatched_pairs(stack), time.monotonic()
                roll()
                ended = time.monotonic()
                time.sleep(2.0)  # requests that started during the roll finish meanwhile
                during = [o for o in load.outcomes if started <= o.started < ended]
                results.append(summarize(name, during, refs, mismatched_pairs(stack) - pairs, ended - started))
    finally:
        stack.stop()
    report = {
        "phases": results,
        "failed": sum(r["failed"] for r in results),
        "truncated_streams": sum(r["truncated_streams"] for r in results),
        "wrong": sum(r["wrong"] for r in results),
        "mismatched_pairs": sum(r["mismatched_pairs"] for r in results),
        "concurrency": concurrency,
    }
    print(
        f"{'phase':<14}{'seconds':>8}{'requests':>9}{'streams':>8}{'failed':>7}{'truncated':>10}{'wrong':>6}{'pairs!':>7}"
    )
    for r in results:
        print(
            f"{r['name']:<14}{r['seconds']:>8}{r['requests']:>9}{r['streams']:>8}{r['failed']:>7}"
            f"{r['truncated_streams']:>10}{r['wrong']:>6}{r['mismatched_pairs']:>7}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
