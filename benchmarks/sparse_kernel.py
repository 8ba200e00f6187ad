"""What the sparse rows' attention costs by *which* blocks a selection keeps: vLLM's CPU kernel as
the served path calls it (one sequence per request and KV head, ``ucm.integration.vllm.attention``),
the same number of blocks kept in every case, side by side in one run.

``benchmarks/sparse_serving.py`` measures its speed rows on one shared document (prefill of 8
distinct 32k documents takes half an hour on 2 cores), and its bound is a static selection (sinks
and the most recent blocks): every row then keeps the *same* physical blocks, which a row's first
read brings into the last-level cache for the others. A scoring selection keeps blocks of its own
per row and KV head. This benchmark separates the two effects, on random keys and values (the kernel
reads the same bytes whatever they hold):

  window, one document       sinks + newest blocks, rows sharing the document (the serving bound)
  window, own documents      the same pattern, every row its own document's blocks
  scattered, same per row    blocks spread over the document, the same for every row
  scattered, one document    blocks spread over the document, each row and KV head its own
  scattered, own documents   ... and every row its own document
  floor (hot)                the first case with one layer called over and over: its blocks stay
                             in cache, what the kernel costs when memory costs nothing

Per case: ms per layer (``--layers`` layers in turn, each its own cache: a layer's blocks are cold
when it comes round again, as in a forward pass), median of ``--repeats`` rounds (each round runs
every case in turn), the distinct blocks a layer reads, and the case's time over the window on own
documents (a static selection without the shared document's help). With ``--huge-pages`` every case
but the floor runs a second time, in the same rounds, on a copy of the caches on 2 MiB pages (the
connector's ``huge_pages``; needs transparent_hugepage "madvise" or "always").

    python benchmarks/sparse_kernel.py --json OUT.json     # ~1 min on 2 cores, ~2 GB of memory
    python benchmarks/sparse_kernel.py --huge-pages        # ~2 min, ~4 GB
    python benchmarks/sparse_kernel.py --rows 2 --context 512 --layers 2 --repeats 1 --huge-pages  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from real_model import serving_dtype  # benchmarks/ is on sys.path when run as a script
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from ucm.hugepages import huge_zeros, thp_mode
from ucm.integration.vllm.attention import KernelShape, attend

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
OWN_BLOCKS = 2  # each row's distinct ending (sparse_serving.py: its last 64 tokens)


def tables(rows: int, n: int, kept: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Per case, the per-head table ``(rows * Hkv, kept)``: row ``phys * Hkv + head``. Logical block
    ``b`` of row ``r`` lies at ``b`` on one document (the last OWN_BLOCKS blocks are the row's own) or
    at ``r * n + b`` when every row has its own document."""

    def table(pick: Callable[[int, int], torch.Tensor], own_documents: bool) -> torch.Tensor:
        t = torch.empty(rows, KV_HEADS, kept, dtype=torch.long)
        shared = n - OWN_BLOCKS
        for r in range(rows):
            for h in range(KV_HEADS):
                logical = pick(r, h)
                if own_documents:
                    phys = r * n + logical
                else:
                    phys = torch.where(logical < shared, logical, rows * n + r * OWN_BLOCKS + logical - shared)
                t[r, h] = phys * KV_HEADS + h
        return t.reshape(rows * KV_HEADS, kept).to(torch.int32)

    window = torch.cat([torch.tensor([0]), torch.arange(n - kept + 1, n)])

    def spread() -> torch.Tensor:
        return torch.sort(torch.randperm(n, generator=generator)[:kept]).values

    per_head = [spread() for _ in range(KV_HEADS)]
    per_row = [[spread() for _ in range(KV_HEADS)] for _ in range(rows)]
    return {
        "window, one document": table(lambda r, h: window, False),
        "window, own documents": table(lambda r, h: window, True),
        "scattered, same per row": table(lambda r, h: per_head[h], False),
        "scattered, one document": table(lambda r, h: per_row[r][h], False),
        "scattered, own documents": table(lambda r, h: per_row[r][h], True),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, serving_dtype())
    b = args.block_size
    n = (args.context + b - 1) // b
    kept = max(2, round(args.ratio * n))
    blocks = args.rows * n + args.rows * OWN_BLOCKS  # room for own documents and the rows' own endings
    shape = KernelShape(HEADS, KV_HEADS, HEAD_DIM, dtype, _get_attn_isa(dtype, b, HEAD_DIM), "auto")
    # A layer's cache as the sparse rows' call sees it: one KV head per block (row phys * Hkv + head).
    caches = [torch.randn(blocks * KV_HEADS, 1, 2 * b, HEAD_DIM, dtype=dtype) for _ in range(args.layers)]
    # The same caches on 2 MiB pages (what UCMConnector's huge_pages asks for), timed beside them.
    huge = [huge_zeros(*c.shape, dtype=dtype).copy_(c) for c in caches] if args.huge_pages else []
    sequences = args.rows * KV_HEADS
    query = torch.randn(sequences, HEADS // KV_HEADS, HEAD_DIM, dtype=dtype)
    out = torch.empty_like(query)
    lens = torch.full((sequences,), kept * b, dtype=torch.int32)
    starts = torch.arange(sequences + 1, dtype=torch.int32)
    schedule = shape.per_head_schedule(lens)
    # Per case: its table, and the layers' caches it goes through in turn.
    cases = {
        name: (table, caches) for name, table in tables(args.rows, n, kept, torch.Generator().manual_seed(1)).items()
    }
    cases["floor (hot)"] = (cases["window, one document"][0], [caches[0]] * len(caches))
    if huge:
        cases |= {f"{name}, 2 MiB pages": (table, huge) for name, (table, _) in list(cases.items())[:-1]}

    def layer(cache: torch.Tensor, table: torch.Tensor) -> None:
        attend(query, *cache.chunk(2, dim=2), out, starts, lens, table, schedule, scale=HEAD_DIM**-0.5)

    def timed(table: torch.Tensor, layers: list[torch.Tensor]) -> float:
        layer(layers[0], table)  # warm the kernel (and, for the floor, the blocks)
        started = time.perf_counter()
        for cache in layers:
            layer(cache, table)
        return (time.perf_counter() - started) / len(layers) * 1e3

    ms: dict[str, list[float]] = {name: [] for name in cases}
    finite = True  # every case's attention output (random inputs: a wrong table reads garbage or faults)
    for _ in range(args.repeats):
        for name, (table, layers) in cases.items():
            ms[name].append(timed(table, layers))
            finite = finite and bool(torch.isfinite(out).all())
    reference = statistics.median(ms["window, own documents"])
    results = []
    for name, (table, _) in cases.items():
        median = statistics.median(ms[name])
        results.append(
            {
                "case": name,
                "ms_per_layer": round(median, 3),
                "runs_ms": [round(x, 3) for x in ms[name]],
                "distinct_blocks_per_layer": int(torch.unique(table.long() // KV_HEADS).numel()),
                "vs_window_own_documents": round(median / reference, 3),
            }
        )
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "rows": args.rows,
        "context_tokens": args.context,
        "blocks_per_row": n,
        "kept_per_row_and_head": kept,
        "layers": args.layers,
        "threads": args.threads,
        "transparent_hugepage": thp_mode(),
        "output_finite": finite,
        "cases": results,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="requests decoding at once")
    p.add_argument("--context", type=int, default=32000, help="tokens per request")
    p.add_argument("--ratio", type=float, default=0.3, help="share of a request's blocks each KV head keeps")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=8, help="layers called in turn, each with its own cache")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the kernel's OpenMP threads)")
    p.add_argument("--repeats", type=int, default=7, help="rounds; each runs every case once")
    p.add_argument(
        "--huge-pages", action="store_true", help="every case but the floor also on a copy of the caches on 2 MiB pages"
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    report = run(args)
    print(
        f"{report['rows']} rows x {report['context_tokens']} tokens, {report['kept_per_row_and_head']} of "
        f"{report['blocks_per_row']} blocks kept per row and KV head, {report['dtype']}, "
        f"{report['threads']} threads"
    )
    print(f"{'case':40} {'ms/layer':>9} {'distinct blocks':>16} {'vs window, own documents':>25}")
    for c in report["cases"]:
        print(
            f"{c['case']:40} {c['ms_per_layer']:9.3f} {c['distinct_blocks_per_layer']:16d} "
            f"{c['vs_window_own_documents']:25.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
