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

Without a GPU (``make test``'s smoke: ``--tokens 128 --requests 2``) it runs what the CPU can: the
decode step's Triton kernels under Triton's interpreter, dense attention with torch's CPU SDPA; the
report's ``not_run`` names what needed the GPU (the transfer part, the CUDA graphs) and its times
are the interpreter's, not measurements. On either device the step checks itself: the paged kernel
over every block against dense attention over the same keys (``paged_dense_max_abs_err``) and the
selection keeping its budget of blocks per KV head (``kept_as_budgeted``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import torch

GPU = torch.cuda.is_available()
if not GPU:  # Triton reads it when it first decorates its own library: before the imports below
    os.environ["TRITON_INTERPRET"] = "1"

import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from ucm import native  # noqa: E402
from ucm.sparse.summaries import QUANTIZED, Scoring  # noqa: E402
from ucm.sparse.triton_attention import sparse_decode  # noqa: E402
from ucm.sparse.triton_select import TritonSelector  # noqa: E402

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
DEVICE = "cuda" if GPU else "cpu"
NOT_RUN_ON_CPU = {
    "transfer": "ucm_native's CUDA kernel, pinned host memory and cudaMemcpy need a GPU",
    "select_graph_ms, step_graph_ms": "CUDA graphs need a GPU (reported as null)",
    "dense flash kernel": "torch SDPA's flash kernel is the GPU's; the CPU runs its own SDPA",
}


def ms(fn: Any) -> float:
    if GPU:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200))
    started = time.perf_counter()  # one call under the interpreter: the flow, not a measurement
    fn()
    return (time.perf_counter() - started) * 1e3


def transfer(request_blocks: int) -> dict[str, float]:
    pool = 4 * request_blocks
    layers = [(torch.randn(2, pool, BLOCK, 8, 128, device=DEVICE, dtype=torch.bfloat16), 1) for _ in range(LAYERS)]
    blocks = torch.randperm(pool, generator=torch.Generator().manual_seed(0))[:request_blocks].tolist()
    width = native.payload_bytes(layers)
    buf = torch.empty(request_blocks, width, dtype=torch.uint8, pin_memory=True)
    flat = torch.empty(request_blocks * width, dtype=torch.uint8, device=DEVICE)
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
    keys = torch.randn(pool, BLOCK, hkv, dim, device=DEVICE, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    tables = torch.randperm(pool, device=DEVICE).to(torch.int32).view(requests, width)
    sel = TritonSelector(SCORINGS[scoring], pool, BLOCK, hkv, dim, DEVICE)
    sel.summarize(keys, tables.flatten().contiguous(), torch.full((pool,), BLOCK, dtype=torch.int32, device=DEVICE))
    query = torch.randn(requests, hq, dim, device=DEVICE, dtype=torch.bfloat16)
    rows = torch.arange(requests, dtype=torch.int32, device=DEVICE)
    lens = torch.full((requests,), tokens, dtype=torch.int32, device=DEVICE)
    keep = max(3, int(ratio * width))
    budget = torch.full((requests,), keep, dtype=torch.int32, device=DEVICE)
    out = torch.empty(requests * hkv, keep, dtype=torch.int32, device=DEVICE)
    kept = torch.empty(requests * hkv, dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(dim)
    written = tables[:, -1].contiguous()
    fills = torch.full((requests,), BLOCK, dtype=torch.int32, device=DEVICE)
    heads = torch.arange(hkv, device=DEVICE, dtype=torch.int32)
    every = (tables[:, None, :] * hkv + heads[None, :, None]).reshape(requests * hkv, width).contiguous()
    all_kept = torch.full((requests * hkv,), width, dtype=torch.int32, device=DEVICE)

    # Dense: K and V of each request contiguous per KV head; the group's query heads as query rows.
    k = torch.randn(requests, hkv, tokens, dim, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = query.view(requests, hkv, g, dim)

    def dense() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION if GPU else SDPBackend.MATH):
            F.scaled_dot_product_attention(q, k, v, scale=scale)

    def select(mass: float = 0.0) -> None:
        sel.select(query, rows, tables, lens, budget, (1, 2), scale, out, mass=mass, kept=kept)

    def attend(blocks: torch.Tensor, counts: torch.Tensor) -> None:
        sparse_decode(query, rows, keys, values, blocks, counts, tables, lens, scale)

    def step() -> None:
        select()
        attend(out, kept)

    # The step's own check: the paged kernel over every block is attention over the request's keys.
    paged = sparse_decode(query, rows, keys, values, every, all_kept, tables, lens, scale).float()
    gathered_k, gathered_v = (c[tables.long()].flatten(1, 2).transpose(1, 2).float() for c in (keys, values))
    reference = F.scaled_dot_product_attention(
        query.float().view(requests, hkv, g, dim), gathered_k, gathered_v, scale=scale
    )
    paged_err = (paged.view(requests, hkv, g, dim) - reference).abs().max().item()

    dense_ms = ms(dense)
    paged_dense_ms = ms(lambda: attend(every, all_kept))
    select_ms = ms(select)
    adaptive_ms = ms(lambda: select(0.9))
    select()
    kept_as_budgeted = bool((kept == keep).all())
    sparse_ms = ms(lambda: attend(out, kept))
    summarize_ms = ms(lambda: sel.summarize(keys, written, fills))
    graphs = {}
    if GPU:
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
        "select_graph_ms": ms(graphs["select"].replay) if GPU else None,
        "sparse_attention_ms": sparse_ms,
        "summarize_ms": summarize_ms,
        "step_ms": step_ms,
        "step_graph_ms": ms(graphs["step"].replay) + summarize_ms if GPU else None,
        "paged_dense_max_abs_err": paged_err,
        "kept_as_budgeted": kept_as_budgeted,
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
    ap.add_argument("--tokens", default="4096,32768,131072", help="decode step's context lengths (multiples of 32)")
    args = ap.parse_args()
    scorings = args.scorings.split(",")
    if unknown := set(scorings) - set(SCORINGS):
        ap.error(f"--scorings: {', '.join(sorted(unknown))} unknown; choose from {', '.join(SCORINGS)}")
    contexts = [int(t) for t in args.tokens.split(",")]
    if any(t <= 0 or t % BLOCK for t in contexts):
        ap.error(f"--tokens: {args.tokens}: each a positive multiple of {BLOCK}")
    device = torch.cuda.get_device_name() if GPU else "cpu (no GPU: Triton's interpreter, times not measurements)"
    report: dict[str, Any] = {"device": device, "torch": torch.__version__, "not_run": {}}
    parts = set(args.parts.split(","))
    if not GPU:
        report["not_run"] = {k: v for k, v in NOT_RUN_ON_CPU.items() if k != "transfer" or "transfer" in parts}
        for part, why in report["not_run"].items():
            print(f"gpu_paths: NOT RUN without a GPU: {part} ({why})", flush=True)
    if "transfer" in parts and GPU:
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
                for tokens in contexts:
                    r = decode_step(scoring, shape, tokens, args.requests, args.ratio)
                    report["decode_step"][f"{scoring}/{shape}/{tokens}"] = r
                    cells = (f"{r[k]:8.3f}" if r[k] is not None else f"{'-':>8}" for k in STEP_KEYS)
                    print(f"{scoring:>5} {shape:>13} {tokens:>8}", " ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
