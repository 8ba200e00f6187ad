"""Time to first token with UCMConnector vs recompute, vLLM's prefix cache and ExampleConnector.

Real vLLM (CPU build) servers on the generated bench model (hidden 1024, 8 layers, float32,
32 KiB of KV per token), ~2,000-token prompts, TTFT = a completion with max_tokens=1. Every case
runs in the same run, one engine at a time (the only one on the cores while it is timed):

  plain (prefix cache on)   recompute (fresh prompt), prefix-cache warm (the same prompt again)
  Example writer            Example cold; 8 prompts of 1,500 shared + 128 unique tokens (bytes stored)
  UCM posix writer          UCM cold; the same 8 prompts (bytes stored)
  Example reader (new)      Example warm, from the page cache and from disk
  UCM posix reader (new)    UCM warm, the same two ways; UCM partial prefix (75% shared with a stored prompt)
  UCM cache|posix           a writer (cold), then a new reader (warm)

"Warm" is KV in DRAM, the case the targets are for: the store's files are read into the page cache
before each such request. "From disk" drops them from it first (posix_fadvise), which is what a
machine's own reclaim does to files left alone (this VM's drops page cache idle for ~60 s), so
neither depends on how long a run happened to leave the files alone.

    python benchmarks/connector_ttft.py --json OUT.json
    python benchmarks/connector_ttft.py --smoke --json OUT.json   # make test's: the flow, not the figures
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ucm.deploy.demo_model import BENCH, TINY, ensure_model
from ucm.integration.vllm.config import kv_transfer_config
from ucm_testing.vllm_server import VLLMServer

BLOCK = 32
IDLE_S = 1.5


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def settled_bytes(path: Path, quiet_s: float = 1.0, timeout_s: float = 60.0) -> int:
    """Directory size once background writes have stopped changing it."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        size = dir_bytes(path)
        if size == last:
            return size
        last = size
        time.sleep(quiet_s)
    return last


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="ucm-ttft-", dir=args.dir))
        self.spec = TINY if args.smoke else BENCH
        self.model = ensure_model(self.spec)
        self.logs = self.work / "logs"
        self.logs.mkdir()
        self.rng = random.Random(7)
        self.vocab = list(range(10, 500))  # ordinary tokens of the 512-token vocabulary
        self.ttft: dict[str, list[float]] = {}
        self.loads: dict[str, list[float]] = {}  # case -> [bytes, seconds] the connector loaded
        self.extra: dict[str, Any] = {}

    def prompt(self, n: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(n)]

    def server(self, name: str, kv: dict[str, Any] | None = None) -> VLLMServer:
        return VLLMServer(
            self.model, self.logs / f"{name}.log", kv_transfer_config=kv, kv_cache_gib=self.args.kv_cache_gib
        ).start()

    @contextlib.contextmanager
    def alone(self, name: str, kv: dict[str, Any] | None = None) -> Iterator[VLLMServer]:
        """An engine that is the only one running while it is timed (engines sharing two cores
        measure contention, not the connector); its page cache writes are flushed after it."""
        server = self.server(name, kv)
        try:
            yield server.wait_ready()
        finally:
            server.stop()
            os.sync()

    def time_first_token(self, case: str, server: VLLMServer, prompt: list[int]) -> float:
        # vLLM workers busy-poll for 1 s after each request: let the engine go idle first, or its
        # poll of the previous case steals CPU from this one.
        time.sleep(IDLE_S)
        start = time.perf_counter()
        server.complete(prompt, max_tokens=1)
        elapsed = time.perf_counter() - start
        self.ttft.setdefault(case, []).append(elapsed)
        return elapsed

    def time_load(self, case: str, server: VLLMServer, prompt: list[int]) -> None:
        """A timed request to a UCM engine, and the bytes and seconds its connector loaded."""
        before = server.metrics()
        self.time_first_token(case, server, prompt)
        after = server.metrics()
        totals = self.loads.setdefault(case, [0.0, 0.0])
        for i, name in enumerate(("ucm_connector_loaded_bytes_total", "ucm_connector_load_seconds_sum")):
            totals[i] += after.get(name, 0.0) - before.get(name, 0.0)

    def run(self) -> dict[str, Any]:
        n, trials = self.args.prompt_tokens, self.args.trials
        ex_dir, ucm_dir, tier_dir = (self.work / d for d in ("example", "ucm", "tiered"))
        for d in (ex_dir, ucm_dir, tier_dir):
            d.mkdir()
        example_kv = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(ex_dir)},
        }
        posix = {"spec": "posix", "posix": {"roots": [str(ucm_dir)]}}
        tiered = {"spec": "cache|posix", "cache": {"capacity": "2GiB"}, "posix": {"roots": [str(tier_dir)]}}
        fresh = [self.prompt(n) for _ in range(trials)]
        ex_prompts = [self.prompt(n) for _ in range(trials)]
        ucm_prompts = [self.prompt(n) for _ in range(trials)]
        ex_disk, ucm_disk = ([self.prompt(n) for _ in range(trials)] for _ in range(2))  # read from disk
        stored = [self.prompt(n) for _ in range(trials)]
        partial = [p[: n * 3 // 4] + self.prompt(n - n * 3 // 4) for p in stored]
        tier_prompts = [self.prompt(n) for _ in range(trials)]

        def plain_case() -> None:
            with self.alone("plain") as plain:
                for t in range(trials):
                    self.time_first_token("recompute", plain, fresh[t])
                    self.time_first_token("prefix_cache_warm", plain, fresh[t])

        def example_cases() -> None:
            with self.alone("example-1", example_kv) as ex1:
                for t in range(trials):
                    self.time_first_token("example_cold", ex1, ex_prompts[t])
                    ex1.complete(ex_disk[t], max_tokens=1)
                stored_bytes["example"], stored_bytes["tokens"] = self.stored_bytes(ex1, ex_dir)
            with self.alone("example-2", example_kv) as ex2:
                for t in range(trials):
                    page_cache(ex_dir, resident=True)
                    self.time_first_token("example_warm", ex2, ex_prompts[t])
                    page_cache(ex_dir, resident=False)
                    self.time_first_token("example_warm_from_disk", ex2, ex_disk[t])

        def ucm_cases() -> None:
            with self.alone("ucm-1", kv_transfer_config(posix)) as u1:
                for t in range(trials):
                    self.time_first_token("ucm_posix_cold", u1, ucm_prompts[t])
                    u1.complete(stored[t], max_tokens=1)
                    u1.complete(ucm_disk[t], max_tokens=1)
                stored_bytes["ucm"], _ = self.stored_bytes(u1, ucm_dir)
            with self.alone("ucm-2", kv_transfer_config(posix)) as u2:
                for t in range(trials):
                    page_cache(ucm_dir, resident=True)
                    self.time_load("ucm_posix_warm", u2, ucm_prompts[t])
                    self.time_load("ucm_partial_prefix", u2, partial[t])
                    page_cache(ucm_dir, resident=False)
                    self.time_load("ucm_posix_warm_from_disk", u2, ucm_disk[t])

        def tiered_cases() -> None:
            for phase in ("cold", "warm"):
                with self.alone(f"tiered-{phase}", kv_transfer_config(tiered)) as tier:
                    for t in range(trials):
                        page_cache(tier_dir, resident=True)
                        self.time_first_token(f"ucm_cache_posix_{phase}", tier, tier_prompts[t])

        stored_bytes: dict[str, int] = {}
        # Each chain of engines (a writer, then a fresh reader) depends on no other. Timed, they run
        # one engine at a time; the smoke's figures mean nothing, so there the chains overlap.
        chains = (plain_case, example_cases, ucm_cases, tiered_cases)
        with ThreadPoolExecutor(len(chains) if self.args.smoke else 1) as pool:
            for chain in [pool.submit(c) for c in chains]:
                chain.result()
        tokens = stored_bytes["tokens"]
        self.extra["storage"] = {
            "example_bytes": stored_bytes["example"],
            "ucm_bytes": stored_bytes["ucm"],
            "prompt_tokens": tokens,
            "example_bytes_per_token": stored_bytes["example"] / tokens,
            "ucm_bytes_per_token": stored_bytes["ucm"] / tokens,
        }
        return self.report()

    def stored_bytes(self, server: VLLMServer, store: Path) -> tuple[int, int]:
        """Bytes a store grows by for 8 prompts sharing a 1,500-token prefix, and their tokens (the
        same prompts for every store: the generator is reseeded)."""
        rng = random.Random(1500)
        shared = [rng.choice(self.vocab) for _ in range(1500)]
        prompts = [shared + [rng.choice(self.vocab) for _ in range(128)] for _ in range(8)]
        before = settled_bytes(store)
        for p in prompts:
            server.complete(p, max_tokens=1)
        return settled_bytes(store) - before, sum(len(p) for p in prompts)

    def report(self) -> dict[str, Any]:
        med = {case: statistics.median(v) for case, v in self.ttft.items()}
        rec = med["recompute"]
        storage = self.extra["storage"]
        return {
            "model": self.spec.name,
            "prompt_tokens": self.args.prompt_tokens,
            "trials": self.args.trials,
            "ttft_s": {
                case: {"median": m, "samples": self.ttft[case], "speedup_vs_recompute": rec / m}
                for case, m in med.items()
            },
            "ucm_effective_load_gbps": {
                case: nbytes / secs / 1e9 for case, (nbytes, secs) in self.loads.items() if secs > 0
            },
            "storage": storage,
            "cold_overhead": med["ucm_posix_cold"] / rec,
            "warm_vs_example": med["ucm_posix_warm"] / med["example_warm"],
            "warm_vs_prefix_cache": med["ucm_posix_warm"] / med["prefix_cache_warm"],
            "warm_from_disk_vs_example": med["ucm_posix_warm_from_disk"] / med["example_warm_from_disk"],
            "partial_prefix_speedup": rec / med["ucm_partial_prefix"],
            "store_bytes_vs_example": storage["ucm_bytes"] / storage["example_bytes"],
        }

    def close(self) -> None:
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def page_cache(store: Path, resident: bool) -> None:
    """Every file of ``store`` read into the page cache, or dropped from it (clean pages: each
    engine's writes were synced when it stopped)."""
    chunk = bytearray(1 << 20)
    for path in store.rglob("*"):
        if not path.is_file():
            continue
        if not resident:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            continue
        with path.open("rb", buffering=0) as f:
            while f.readinto(chunk):
                pass


def print_report(r: dict[str, Any]) -> None:
    print(f"{'case':<24}{'median TTFT s':>15}{'vs recompute':>14}")
    for case, v in r["ttft_s"].items():
        print(f"{case:<24}{v['median']:>15.3f}{v['speedup_vs_recompute']:>13.1f}x")
    s = r["storage"]
    print(f"\nbytes per prompt token: UCM {s['ucm_bytes_per_token']:.0f}, Example {s['example_bytes_per_token']:.0f}")
    for case, gbps in r["ucm_effective_load_gbps"].items():
        print(f"UCM effective load, {case}: {gbps:.2f} GB/s")
    for key, target in (
        ("cold_overhead", "<= 1.05"),
        ("warm_vs_example", "<= 0.85"),
        ("warm_vs_prefix_cache", "<= 1.3"),
        ("warm_from_disk_vs_example", "none (reported)"),
        ("partial_prefix_speedup", ">= 2.5"),
        ("store_bytes_vs_example", "<= 0.25"),
    ):
        print(f"{key:<24}{r[key]:>8.3f}   target {target}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where stores live (default: the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep stores and logs")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every case at its smallest (make test): the tiny demo model, 1 trial of 256-token prompts, "
        "the four chains of engines (plain, Example, UCM, cache|posix) side by side; the flow, not the figures",
    )
    args = parser.parse_args()
    if args.smoke:
        args.trials, args.prompt_tokens = 1, 256
    bench = Bench(args)
    try:
        report = bench.run()
    finally:
        bench.close()
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
