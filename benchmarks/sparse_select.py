"""One layer's block selection (the native kernel the served path calls) under the conditions a vLLM
CPU worker runs it in, side by side in one run: what the kernel costs alone, and what the engine's
surroundings add.

Per algorithm (its default options, or a variant such as ``gsa:summary_dtype=bfloat16``), ``--rows``
requests of ``--context`` tokens sharing their blocks as a shared document does
(``--distinct-documents``: each its own blocks, shuffled over the cache as a long-running engine's
allocator leaves them), ``--layers`` layers each with its own summaries (the engine's per-layer
tensors, sized for ``--num-blocks`` physical blocks). Every case runs in its own process (OpenMP
reads its settings once):

  threads      2 bound: two OpenMP threads pinned to cores 0 and 1 (GOMP_CPU_AFFINITY, what a
               vLLM CPU worker sets); 2 unbound; 1
  neighbour    none, or one process spinning on sched_yield (what vLLM's engine core does while it
               waits for the worker's step)
  memory       warm: one layer's summaries, call after call; cold: the layers in turn, and 64 MiB
               written between calls (what a layer's attention does to the caches)

Reported per case: mean, p50 and p99 ms per layer call (200 calls after a warm-up), and the floor:
one pass over the representation bytes the call scores (each distinct block's, gathered with
``index_select``), timed in the same process and memory state — what a selection that only read
its inputs once would cost.

    python benchmarks/sparse_select.py --json OUT.json        # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from variants import parse_variant  # benchmarks/ is on sys.path when run as a script

THREADS = {"2 bound": {"OMP_NUM_THREADS": "2", "GOMP_CPU_AFFINITY": "0 1"}, "2 unbound": {"OMP_NUM_THREADS": "2"}}
THREADS["1"] = {"OMP_NUM_THREADS": "1"}
NEIGHBOURS = ("none", "spinning")
MEMORY = ("warm", "cold")
ALGORITHMS = ("gsa", "esa", "psa")
SCORED = (*ALGORITHMS, "kvstar")  # those whose summaries are representations (not GSA on-device's hashes)
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
HEADER = (
    f"{'algorithm':22} {'threads':9} {'neighbour':9} {'memory':6} {'mean ms':>8} {'p50':>7} {'p99':>7} {'floor':>7}"
)
SPIN = "import os\nwhile True:\n    os.sched_yield()\n"  # killed when its case ends


def case(algorithm: str, memory: str, args: argparse.Namespace) -> dict[str, float]:
    """Runs inside the case's process: time one layer's selection call after call."""
    import torch

    from ucm.sparse.config import OPTIONS
    from ucm.sparse.summaries import BlockSummaries

    torch.manual_seed(0)
    name, variant = parse_variant(algorithm)
    options = OPTIONS[name](**variant)
    scoring = options.scoring(HEAD_DIM)
    b, rows = args.block_size, args.rows
    n = (args.context + b - 1) // b
    first = args.num_blocks // 4  # where the documents' blocks lie among the physical ones
    used = blocks_used(args)
    layers = []
    for _ in range(args.layers if memory == "cold" else 1):
        summaries = BlockSummaries(scoring, args.num_blocks, b, KV_HEADS, HEAD_DIM, torch.float32)
        slots = torch.arange(first * b, (first + used) * b)
        summaries.write(torch.randn(len(slots), KV_HEADS, HEAD_DIM), slots)
        layers.append(summaries)
    if args.distinct_documents:
        tables = (first + torch.randperm(used)).to(torch.int32).view(rows, n)
    else:
        tables = torch.arange(first, first + n, dtype=torch.int32).repeat(rows, 1)
        tables[:, -1] = torch.arange(first + n, first + n + rows, dtype=torch.int32)  # each row's own last block
    seq_lens = torch.full((rows,), n * b - b // 2, dtype=torch.int32)
    budget = options.budget_blocks(torch.full((rows,), n), b).to(torch.int32)
    tokens = torch.arange(rows, dtype=torch.int32)
    query = torch.randn(rows, HEADS, HEAD_DIM)
    out = torch.zeros(rows * KV_HEADS, n, dtype=torch.int32)
    kept = torch.empty(rows * KV_HEADS, dtype=torch.int32)
    prior = torch.zeros(args.num_blocks, KV_HEADS)
    distinct = torch.unique(tables).long()
    sweep = torch.empty(64 << 20, dtype=torch.uint8)

    windows, counts = options.windows(b), kept if scoring.mass > 0 else None  # as the runtime holds them

    def select(summaries: BlockSummaries) -> None:
        summaries.select(
            query, tokens, tables, seq_lens, budget, windows, HEAD_DIM**-0.5, out,
            mass=scoring.mass, kept=counts, prior=prior,
        )  # fmt: skip

    def read(summaries: BlockSummaries) -> None:
        summaries.rep.index_select(0, distinct)
        if summaries.rep_scale.numel():
            summaries.rep_scale.index_select(0, distinct)

    timings: dict[str, list[float]] = {"select": [], "floor": []}
    for i in range(args.calls + len(layers)):
        for name, fn in (("select", select), ("floor", read)):
            summaries = layers[i % len(layers)]
            if memory == "cold":
                sweep.add_(1)
            started = time.perf_counter()
            fn(summaries)
            if i >= len(layers):  # the first pass over the layers warms up
                timings[name].append(time.perf_counter() - started)
    result = {}
    for name, values in timings.items():
        values.sort()
        result[f"{name}_mean_ms"] = 1e3 * sum(values) / len(values)
        result[f"{name}_p50_ms"] = 1e3 * values[len(values) // 2]
        result[f"{name}_p99_ms"] = 1e3 * values[int(len(values) * 0.99)]
    return result


def blocks_used(args: argparse.Namespace) -> int:
    """Physical blocks the rows' tables name: one document and each row's own last block, or every
    row's own document."""
    n = (args.context + args.block_size - 1) // args.block_size
    return args.rows * n if args.distinct_documents else n + args.rows


def settings(smoke: bool) -> list[tuple[str, str, str]]:
    """(threads, neighbour, memory) of every case an algorithm runs: all of them, or with --smoke
    the worker's threads and each neighbour and memory state once."""
    if smoke:
        return [("2 bound", "none", "warm"), ("2 bound", "spinning", "cold")]
    return [(t, n, m) for t in THREADS for n in NEIGHBOURS for m in MEMORY]


def run(args: argparse.Namespace) -> dict[str, Any]:
    cases = []
    print(HEADER)
    for algorithm in args.algorithms.split(","):
        for threads, neighbour, memory in settings(args.smoke):
            env = THREADS[threads]
            spinner = None
            if neighbour == "spinning":
                spinner = subprocess.Popen([sys.executable, "-c", SPIN])
            try:
                child = subprocess.run(
                    [sys.executable, __file__, *sys.argv[1:], "--case", f"{algorithm},{memory}"],
                    env={**os.environ, **env},
                    capture_output=True,
                    text=True,
                    check=True,
                )
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            result = json.loads(child.stdout.splitlines()[-1])
            cases.append(
                {"algorithm": algorithm, "threads": threads, "neighbour": neighbour, "memory": memory, **result}
            )
            print_row(cases[-1])
    return {
        "rows": args.rows,
        "context": args.context,
        "block_size": args.block_size,
        "layers": args.layers,
        "distinct_documents": args.distinct_documents,
        "cases": cases,
    }


def print_row(c: dict[str, Any]) -> None:
    print(
        f"{c['algorithm']:22} {c['threads']:9} {c['neighbour']:9} {c['memory']:6} {c['select_mean_ms']:8.3f} "
        f"{c['select_p50_ms']:7.3f} {c['select_p99_ms']:7.3f} {c['floor_mean_ms']:7.3f}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=16000)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=28, help="sparse layers (SmolLM2: 30, the first 2 dense)")
    parser.add_argument("--num-blocks", type=int, default=20000, help="physical blocks the summaries are sized for")
    parser.add_argument("--distinct-documents", action="store_true", help="each row its own blocks, shuffled")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the flow at its smallest (make test): 2 cases per algorithm (the worker's threads; each neighbour "
        "and memory state once), 2 rows of 512 tokens, 2 layers, 5 calls",
    )
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.context, args.layers, args.num_blocks, args.calls = 2, 512, 2, 256, 5
    unknown = sorted({parse_variant(name)[0] for name in args.algorithms.split(",")} - set(SCORED))
    if unknown:
        parser.error(f"--algorithms: {unknown[0]!r} is not one of {', '.join(SCORED)}")
    if args.num_blocks // 4 + blocks_used(args) > args.num_blocks:  # the tables start a quarter in
        parser.error(f"--num-blocks: {args.num_blocks} is too few for --rows {args.rows} of --context {args.context}")
    if args.case:
        algorithm, memory = args.case.split(",")
        print(json.dumps(case(algorithm, memory, args)))
        return 0
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
