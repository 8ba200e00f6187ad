"""Time to first token with UCMConnector vs recompute, vLLM's prefix cache and ExampleConnector.

Real vLLM (CPU build) servers on the generated bench model (hidden 1024, 8 layers, float32,
32 KiB of KV per token), ~2,000-token prompts, TTFT = a completion with max_tokens=1. Every case
runs in the same run, one engine at a time (the only one on the cores while it is timed):

  plain (prefix cache on)   recompute (fresh prompt), prefix-cache warm (the same prompt again)
  Example writer            Example cold; 8 prompts of 1,500 shared + 128 unique tokens (bytes stored)
  UCM posix writer          UCM cold; the same 8 prompts (bytes stored)
  Example reader (new)      Example warm
  UCM posix reader (new)    UCM warm, UCM partial prefix (75% shared with a stored prompt)
  UCM cache|posix           a writer (cold), then a new reader (warm)

    python benchmarks/connector_ttft.py --json OUT.json
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
from pathlib import Path
from typing import Any

from ucm.deploy.demo_model import BENCH, ensure_model
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
        self.model = ensure_model(BENCH)
        self.logs = self.work / "logs"
        self.logs.mkdir()
        self.rng = random.Random(7)
        self.vocab = list(range(10, 500))  # ordinary tokens of the 512-token vocabulary
        self.ttft: dict[str, list[float]] = {}
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
        stored = [self.prompt(n) for _ in range(trials)]
        partial = [p[: n * 3 // 4] + self.prompt(n - n * 3 // 4) for p in stored]
        tier_prompts = [self.prompt(n) for _ in range(trials)]

        with self.alone("plain") as plain:
            for t in range(trials):
                self.time_first_token("recompute", plain, fresh[t])
                self.time_first_token("prefix_cache_warm", plain, fresh[t])
        with self.alone("example-1", example_kv) as ex1:
            for t in range(trials):
                self.time_first_token("example_cold", ex1, ex_prompts[t])
            example_bytes, tokens = self.stored_bytes(ex1, ex_dir)
        with self.alone("ucm-1", kv_transfer_config(posix)) as u1:
            for t in range(trials):
                self.time_first_token("ucm_posix_cold", u1, ucm_prompts[t])
                u1.complete(stored[t], max_tokens=1)
            ucm_bytes, _ = self.stored_bytes(u1, ucm_dir)
        self.extra["storage"] = {
            "example_bytes": example_bytes,
            "ucm_bytes": ucm_bytes,
            "prompt_tokens": tokens,
            "example_bytes_per_token": example_bytes / tokens,
            "ucm_bytes_per_token": ucm_bytes / tokens,
        }
        with self.alone("example-2", example_kv) as ex2:
            for t in range(trials):
                self.time_first_token("example_warm", ex2, ex_prompts[t])
        with self.alone("ucm-2", kv_transfer_config(posix)) as u2:
            before = u2.metrics()
            for t in range(trials):
                self.time_first_token("ucm_posix_warm", u2, ucm_prompts[t])
                self.time_first_token("ucm_partial_prefix", u2, partial[t])
            self.extra["ucm_load_gbps"] = _gbps(before, u2.metrics())
        for phase in ("cold", "warm"):
            with self.alone(f"tiered-{phase}", kv_transfer_config(tiered)) as tier:
                for t in range(trials):
                    self.time_first_token(f"ucm_cache_posix_{phase}", tier, tier_prompts[t])
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
            "model": BENCH.name,
            "prompt_tokens": self.args.prompt_tokens,
            "trials": self.args.trials,
            "ttft_s": {
                case: {"median": m, "samples": self.ttft[case], "speedup_vs_recompute": rec / m}
                for case, m in med.items()
            },
            "ucm_effective_load_gbps": self.extra.get("ucm_load_gbps"),
            "storage": storage,
            "cold_overhead": med["ucm_posix_cold"] / rec,
            "warm_vs_example": med["ucm_posix_warm"] / med["example_warm"],
            "warm_vs_prefix_cache": med["ucm_posix_warm"] / med["prefix_cache_warm"],
            "partial_prefix_speedup": rec / med["ucm_partial_prefix"],
            "store_bytes_vs_example": storage["ucm_bytes"] / storage["example_bytes"],
        }

    def close(self) -> None:
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def _gbps(before: dict[str, float], after: dict[str, float]) -> float | None:
    nbytes = after.get("ucm_connector_loaded_bytes_total", 0) - before.get("ucm_connector_loaded_bytes_total", 0)
    secs = after.get("ucm_connector_load_seconds_sum", 0) - before.get("ucm_connector_load_seconds_sum", 0)
    return nbytes / secs / 1e9 if secs > 0 else None


def print_report(r: dict[str, Any]) -> None:
    print(f"{'case':<24}{'median TTFT s':>15}{'vs recompute':>14}")
    for case, v in r["ttft_s"].items():
        print(f"{case:<24}{v['median']:>15.3f}{v['speedup_vs_recompute']:>13.1f}x")
    s = r["storage"]
    print(f"\nbytes per prompt token: UCM {s['ucm_bytes_per_token']:.0f}, Example {s['example_bytes_per_token']:.0f}")
    if r["ucm_effective_load_gbps"]:
        print(f"UCM effective load: {r['ucm_effective_load_gbps']:.2f} GB/s")
    for key, target in (
        ("cold_overhead", "<= 1.05"),
        ("warm_vs_example", "<= 0.85"),
        ("warm_vs_prefix_cache", "<= 1.3"),
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
    args = parser.parse_args()
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
