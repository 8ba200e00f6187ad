"""The GPU paths on a real GPU (the device machine; CI has none): KV block transfer and sparse
block selection.

Transfer: a request's blocks between paged KV in GPU memory (32 layers of FlashAttention's layout
[2, num_blocks, 32 tokens, 8 KV heads, 128 dim] bf16) and pinned host memory, one row per block:
  native-cuda  ucm_native's kernel (one launch for every block and layer)
  torch        the reference (index_select + copy per layer)
  bound        one cudaMemcpy of the same bytes between contiguous device and pinned host memory

Selection: one decode step of R requests over N-token contexts, per layer, for two model shapes
(SmolLM2-135M: 9 query heads over 3 KV heads of 64; Llama-3-8B: 32 over 8 of 128), 32-token blocks,
keeping 30% of the blocks:
  dense      the step's attention over every key (torch SDPA, flash kernel: each KV head's query
             group as the query rows; what a dense engine pays, about)
  select     TritonSelector.select: scores from the block representations, windows, top-k per KV head
  adaptive   the same with an adaptive budget (the fewest blocks holding 90% of the estimated share)
  graph      select captured in a CUDA graph and replayed (no launch costs: what a captured step pays)
  summarize  TritonSelector.summarize of the step's R written blocks
  speedup    dense / (ratio x dense + select + summarize): the step's speedup with this selection
             and an ideal sparse kernel (one that reads the kept blocks at dense's speed)
  bound      1 / ratio: the same with a zero-cost selection
  share      select / dense: the part of the saving the selection spends

    python benchmarks/gpu_paths.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from ucm import native
from ucm.sparse.summaries import Scoring
from ucm.sparse.triton_select import TritonSelector

LAYERS, BLOCK = 32, 32
SELECTION_KEYS = (
    "dense_ms",
    "select_ms",
    "select_adaptive_ms",
    "select_graph_ms",
    "summarize_ms",
    "share",
    "speedup",
    "speedup_bound",
)
SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def ms(fn: Any) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200))


def transfer(request_blocks: int) -> dict[str, float]:
    pool = 4 * request_blocks
    layers = [(torch.randn(2, pool, BLOCK, 8, 128, device="cuda", dtype=torch.bfloat16), 1) for _ in range(LAYERS)]
    blocks = torch.randperm(pool, generator=torch.Generator().manual_seed(0))[:request_blocks].tolist()
    width = native.payload_bytes(layers)
    buf = torch.empty(request_blocks, width, dtype=torch.uint8, pin_memory=True)
    flat = torch.empty(request_blocks * width, dtype=torch.uint8, device="cuda")
    gb = buf.numel() / 1e9
    out: dict[str, float] = {"payload_mb": buf.numel() / 1e6}
    os.environ["UCM_NATIVE_CUDA"] = "1"
    out["native_cuda_gather"] = gb / ms(lambda: native.gather(layers, blocks, buf)) * 1e3
    out["native_cuda_scatter"] = gb / ms(lambda: native.scatter(layers, blocks, buf)) * 1e3
    os.environ["UCM_NATIVE_CUDA"] = "0"
    out["torch_gather"] = gb / ms(lambda: native.gather(layers, blocks, buf)) * 1e3
    out["torch_scatter"] = gb / ms(lambda: native.scatter(layers, blocks, buf)) * 1e3
    host = buf.view(-1)
    out["bound_d2h"] = gb / ms(lambda: host.copy_(flat, non_blocking=True)) * 1e3
    out["bound_h2d"] = gb / ms(lambda: flat.copy_(host, non_blocking=True)) * 1e3
    return out


def selection(shape: str, tokens: int, requests: int, ratio: float) -> dict[str, float]:
    hq, hkv, dim = SHAPES[shape]
    g = hq // hkv
    width = tokens // BLOCK
    pool = requests * width
    cache = torch.randn(pool, BLOCK, hkv, dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(pool, device="cuda").to(torch.int32).view(requests, width)
    sel = TritonSelector(Scoring("both"), pool, BLOCK, hkv, dim, "cuda")
    sel.summarize(cache, tables.flatten().contiguous(), torch.full((pool,), BLOCK, dtype=torch.int32, device="cuda"))
    query = torch.randn(requests, hq, dim, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(requests, dtype=torch.int32, device="cuda")
    lens = torch.full((requests,), tokens, dtype=torch.int32, device="cuda")
    keep = max(3, int(ratio * width))
    budget = torch.full((requests,), keep, dtype=torch.int32, device="cuda")
    out = torch.empty(requests * hkv, keep, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(dim)
    written = tables[:, -1].contiguous()
    fills = torch.full((requests,), BLOCK, dtype=torch.int32, device="cuda")

    # Dense: K and V of each request contiguous per KV head; the group's query heads as query rows.
    k = torch.randn(requests, hkv, tokens, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = query.view(requests, hkv, g, dim)

    def dense() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, scale=scale)

    dense_ms = ms(dense)
    select_ms = ms(lambda: sel.select(query, rows, tables, lens, budget, (1, 2), scale, out))
    adaptive_ms = ms(lambda: sel.select(query, rows, tables, lens, budget, (1, 2), scale, out, mass=0.9))
    summarize_ms = ms(lambda: sel.summarize(cache, written, fills))
    graph = torch.cuda.CUDAGraph()  # fixed shapes, no host synchronisation: the step can be captured
    with torch.cuda.graph(graph):
        sel.select(query, rows, tables, lens, budget, (1, 2), scale, out)
    graph_ms = ms(graph.replay)
    return {
        "dense_ms": dense_ms,
        "select_ms": select_ms,
        "select_adaptive_ms": adaptive_ms,
        "select_graph_ms": graph_ms,
        "summarize_ms": summarize_ms,
        "sparse_bound_ms": ratio * dense_ms,
        "share": select_ms / dense_ms,
        "speedup": dense_ms / (ratio * dense_ms + select_ms + summarize_ms),
        "speedup_bound": 1 / ratio,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_paths: no GPU here (run it on the device machine)", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["transfer"] = {str(n): transfer(n) for n in (16, 256)}
    head = ("blocks", "MB", "native g", "native s", "torch g", "torch s", "d2h", "h2d")
    print(" ".join(f"{h:>9}" for h in head), " GB/s")
    for n, r in report["transfer"].items():
        keys = ("native_cuda_gather", "native_cuda_scatter", "torch_gather", "torch_scatter", "bound_d2h", "bound_h2d")
        print(f"{n:>9} {r['payload_mb']:9.0f}", " ".join(f"{r[k]:9.1f}" for k in keys))
    report["selection"] = {}
    head = ("tokens", "dense ms", "select", "adaptive", "graph", "summ.", "share", "speedup", "bound")
    print(f"\n{'shape':>13}", " ".join(f"{h:>8}" for h in head))
    for shape in SHAPES:
        for tokens in (4096, 32768, 131072):
            r = selection(shape, tokens, args.requests, args.ratio)
            report["selection"][f"{shape}/{tokens}"] = r
            print(f"{shape:>13} {tokens:>8}", " ".join(f"{r[k]:8.3f}" for k in SELECTION_KEYS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
