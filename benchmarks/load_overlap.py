"""A warm load overlapped with the forward pass, outside vLLM: the connector's worker half on a real
posix store, each layer waiting for its KV and then computing, side by side in one run.

63 blocks of 1 MiB (the connector_ttft BENCH model's shape: 8 layers, 32 tokens of 32 KiB per
block), read from the page cache into a paged CPU cache by the landed load path, while each layer
"computes" a float32 matmul of about ``--layer-ms`` on torch's threads (the same cores as the
store's I/O threads, as in a CPU engine). Arms, alternating per trial:

  whole    the load lands whole blocks: layer 0 waits for every block (the path before ranges)
  ranged   the load lands ranges of 1, 2, 4, ... layers: each layer waits for its own range
  compute  the layers' compute alone (the bound: a load costing nothing)

Reported: median step time (load + 8 layers), the wait before layer 0, and ranged ÷ whole.

    python benchmarks/load_overlap.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ucm.integration.vllm.layout import KVLayout
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.integration.vllm.stats import StatsRecorder
from ucm.integration.vllm.worker import WorkerSide
from ucm.store import create_store

LAYERS, BLOCKS, TOKENS, WIDTH = 8, 63, 32, 512  # (2, 32, 512) float32 per layer: 128 KiB, 1 MiB per block


def caches(fill: bool) -> dict[str, torch.Tensor]:
    make = torch.randn if fill else torch.zeros
    return {f"model.layers.{i}.attn": make(BLOCKS + 1, 2, TOKENS, WIDTH) for i in range(LAYERS)}


def layer_work(ms: float) -> torch.Tensor:
    """A matmul sized to take about ``ms`` on this machine."""
    a = torch.randn(256, 256)
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < 0.05:
        a @ a
        n += 1
    size = max(1, round(n * ms / 50))
    return torch.stack([a] * size)


def step(w: WorkerSide | None, names: list[str], work: torch.Tensor) -> tuple[float, float]:
    """One forward: (seconds in all, seconds waited before layer 0)."""
    meta = UCMConnectorMetadata(loads=[BlockTransfer("r", IDS, list(range(1, BLOCKS + 1)))])
    started = time.perf_counter()
    first = 0.0
    if w is not None:
        w.start_load(meta)
    for i, name in enumerate(names):
        if w is not None:
            w.wait_layer(name)
        if i == 0:
            first = time.perf_counter() - started
        torch.bmm(work, work)
    if w is not None:
        w.finish_step(meta)
        assert w.take_load_errors() == set()
    return time.perf_counter() - started, first


IDS = [bytes([i % 256, i // 256]) * 16 for i in range(BLOCKS)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--layer-ms", type=float, default=5.0, help="compute per layer (the BENCH model's ~5.3 ms)")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as root:
        config = {"spec": "posix", "posix": {"roots": [root]}}
        writer = WorkerSide(
            create_store(config), rank=0, tp_size=1, load_mode="layer", save_mode="step", stats=StatsRecorder()
        )
        src = caches(True)
        writer.register(src, BLOCKS + 1)
        writer.finish_step(UCMConnectorMetadata(saves=[BlockTransfer("r", IDS, list(range(BLOCKS)))]))
        writer.close()
        dst = caches(False)
        names = list(dst)
        work = layer_work(args.layer_ms)
        arms: dict[str, WorkerSide | None] = {}
        for arm in ("whole", "ranged"):
            w = WorkerSide(
                create_store(config),
                rank=0,
                tp_size=1,
                load_mode="layer",
                save_mode="layer",
                stats=StatsRecorder(),
                load_timeout_s=10,
            )
            w.register(dst, BLOCKS + 1)
            arms[arm] = w
        whole_cuts = KVLayout.layer_cuts
        times: dict[str, list[tuple[float, float]]] = {a: [] for a in ("whole", "ranged", "compute")}
        for _ in range(args.trials + 1):  # the first round warms up and is dropped
            for arm in times:
                KVLayout.layer_cuts = (lambda _self: []) if arm == "whole" else whole_cuts  # type: ignore[method-assign]
                times[arm].append(step(arms.get(arm), names, work))
        KVLayout.layer_cuts = whole_cuts  # type: ignore[method-assign]
        for w in arms.values():
            assert w is not None
            w.close()
    report = {
        arm: {
            "step_ms": 1e3 * statistics.median(t for t, _ in runs[1:]),
            "wait_before_layer0_ms": 1e3 * statistics.median(f for _, f in runs[1:]),
        }
        for arm, runs in times.items()
    }
    report["ranged_vs_whole"] = report["ranged"]["step_ms"] / report["whole"]["step_ms"]
    report["ranged_vs_compute_bound"] = report["ranged"]["step_ms"] / report["compute"]["step_ms"]
    print(f"{'arm':10} {'step ms':>9} {'wait before layer 0 ms':>24}")
    for arm in times:
        print(f"{arm:10} {report[arm]['step_ms']:9.1f} {report[arm]['wait_before_layer0_ms']:24.1f}")
    print(
        f"ranged / whole {report['ranged_vs_whole']:.3f}; ranged / compute alone (the bound) "
        f"{report['ranged_vs_compute_bound']:.3f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
