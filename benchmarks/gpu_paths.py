"""The GPU paths on a real GPU (the device machine; CI has none): KV block transfer, and a sparse
decode step (selection and attention over the kept blocks) against dense attention.

Transfer: a request's blocks between paged KV in GPU memory (32 layers of FlashAttention's layout
[2, num_blocks, 32 tokens, 8 KV heads, 128 dim] bf16) and pinned host memory, one row per block:
  native-cuda  ucm_native's kernel (one launch for every block and layer)
  torch        the reference (index_select + copy per layer)
  bound        one cudaMemcpy of the same bytes between contiguous device and pinned host memory

Decode step: one decode token of R requests over N-token contexts, per layer, for two model shapes
(SmolLM2-135M: 9 query heads over 3 KV heads of 64; Llama-3-8B: 32 over 8 of 128), 32-token blocks,
keeping 30% of the blocks, per scoring (``--scorings``: both, the bfloat16 bound, the int8 bound,
GSA's default), in ms:
  dense      attention over every key (torch SDPA's flash kernel on contiguous K/V, each KV head's
             query group as its rows): what a dense engine pays, about
  paged      ucm.sparse.triton_attention.sparse_decode over every block (the same kernel, dense)
  select     TritonSelector.select: scores from the block representations, windows, top-k per KV head
  adaptive   the same with an adaptive budget (the fewest blocks holding 90% of the estimated share)
  graph      select captured in a CUDA graph and replayed (no launch costs: what a captured step pays)
  sparse     sparse_decode over the kept blocks
  summ.      TritonSelector.summarize of the step's R written blocks
  step gr.   select + sparse captured in one graph, plus summ.
  x dense    dense / (select + sparse + summ.), eager: the sparse step's speedup
  x paged    the same against the paged kernel over every block
  bound      1 / ratio: the speedup of a zero-cost selection with a kernel as fast per block as dense

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
from ucm.sparse.summaries import QUANTIZED, Scoring
from ucm.sparse.triton_attention import sparse_decode
from ucm.sparse.triton_select import TritonSelector

LAYERS, BLOCK = 32, 32
TRANSFER_KEYS = ("native_cuda_gather", "native_cuda_scatter", "torch_gather", "torch_scatter", "bound_d2h", "bound_h2d")
STEP_KEYS = (
    "dense_ms",
    "paged_dense_ms",
    "select_ms",
    "select_adaptive_ms",
    "select_graph_ms",
    "sparse_attention_ms",
    "summarize_ms",
    "step_graph_ms",
    "speedup",
    "speedup_vs_paged_dense",
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


SCORINGS = {"both": Scoring("both"), "bound": Scoring("bound"), "int8": Scoring("bound", dtype=QUANTIZED)}


def decode_step(scoring: str, shape: str, tokens: int, requests: int, ratio: float) -> dict[str, float]:
    hq, hkv, dim = SHAPES[shape]
    g = hq // hkv
    width = tokens // BLOCK
    pool = requests * width
    keys = torch.randn(pool, BLOCK, hkv, dim, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    tables = torch.randperm(pool, device="cuda").to(torch.int32).view(requests, width)
    sel = TritonSelector(SCORINGS[scoring], pool, BLOCK, hkv, dim, "cuda")
    sel.summarize(keys, tables.flatten().contiguous(), torch.full((pool,), BLOCK, dtype=torch.int32, device="cuda"))
    query = torch.randn(requests, hq, dim, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(requests, dtype=torch.int32, device="cuda")
    lens = torch.full((requests,), tokens, dtype=torch.int32, device="cuda")
    keep = max(3, int(ratio * width))
    budget = torch.full((requests,), keep, dtype=torch.int32, device="cuda")
    out = torch.empty(requests * hkv, keep, dtype=torch.int32, device="cuda")
    kept = torch.empty(requests * hkv, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(dim)
    written = tables[:, -1].contiguous()
    fills = torch.full((requests,), BLOCK, dtype=torch.int32, device="cuda")
    heads = torch.arange(hkv, device="cuda", dtype=torch.int32)
    every = (tables[:, None, :] * hkv + heads[None, :, None]).reshape(requests * hkv, width).contiguous()
    all_kept = torch.full((requests * hkv,), width, dtype=torch.int32, device="cuda")

    # Dense: K and V of each request contiguous per KV head; the group's query heads as query rows.
    k = torch.randn(requests, hkv, tokens, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = query.view(requests, hkv, g, dim)

    def dense() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, scale=scale)

    def select(mass: float = 0.0) -> None:
        sel.select(query, rows, tables, lens, budget, (1, 2), scale, out, mass=mass, kept=kept)

    def attend(blocks: torch.Tensor, counts: torch.Tensor) -> None:
        sparse_decode(query, rows, keys, values, blocks, counts, tables, lens, scale)

    def step() -> None:
        select()
        attend(out, kept)

    dense_ms = ms(dense)
    paged_dense_ms = ms(lambda: attend(every, all_kept))
    select_ms = ms(select)
    adaptive_ms = ms(lambda: select(0.9))
    select()
    sparse_ms = ms(lambda: attend(out, kept))
    summarize_ms = ms(lambda: sel.summarize(keys, written, fills))
    graphs = {}
    for name, fn in (("select", select), ("step", step)):  # fixed shapes, no host synchronisation
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            fn()
    step_ms = select_ms + sparse_ms + summarize_ms
    return {
        "dense_ms": dense_ms,
        "paged_dense_ms": paged_dense_ms,
        "select_ms": select_ms,
        "select_adaptive_ms": adaptive_ms,
        "select_graph_ms": ms(graphs["select"].replay),
        "sparse_attention_ms": sparse_ms,
        "summarize_ms": summarize_ms,
        "step_ms": step_ms,
        "step_graph_ms": ms(graphs["step"].replay) + summarize_ms,
        "share": select_ms / dense_ms,
        "speedup": dense_ms / step_ms,
        "speedup_vs_paged_dense": paged_dense_ms / step_ms,
        "speedup_bound": 1 / ratio,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--parts", default="transfer,decode", help="which of transfer, decode to run")
    ap.add_argument("--scorings", default="both,int8", help=f"decode step's selections, of {', '.join(SCORINGS)}")
    args = ap.parse_args()
    scorings = args.scorings.split(",")
    if unknown := set(scorings) - set(SCORINGS):
        ap.error(f"--scorings: {', '.join(sorted(unknown))} unknown; choose from {', '.join(SCORINGS)}")
    if not torch.cuda.is_available():
        print("gpu_paths: no GPU here (run it on the device machine)", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    parts = set(args.parts.split(","))
    if "transfer" in parts:
        report["transfer"] = {str(n): transfer(n) for n in (16, 256)}
        head = ("blocks", "MB", "native g", "native s", "torch g", "torch s", "d2h", "h2d")
        print(" ".join(f"{h:>9}" for h in head), " GB/s")
        for n, r in report["transfer"].items():
            print(f"{n:>9} {r['payload_mb']:9.0f}", " ".join(f"{r[k]:9.1f}" for k in TRANSFER_KEYS))
    if "decode" in parts:
        report["decode_step"] = {}
        head = ("tokens", "dense", "paged", "select", "adaptive", "graph", "sparse", "summ.", "step gr.")
        head += ("x dense", "x paged", "bound")
        print(f"\n{'ms':>19}", " ".join(f"{h:>8}" for h in head))
        for scoring in scorings:
            for shape in SHAPES:
                for tokens in (4096, 32768, 131072):
                    r = decode_step(scoring, shape, tokens, args.requests, args.ratio)
                    report["decode_step"][f"{scoring}/{shape}/{tokens}"] = r
                    print(f"{scoring:>5} {shape:>13} {tokens:>8}", " ".join(f"{r[k]:8.3f}" for k in STEP_KEYS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
