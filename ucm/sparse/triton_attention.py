"""Decode attention over the blocks a selection kept, per KV head, on GPUs (Triton): the GPU
counterpart of the CPU backend's per-head view of the paged cache, reading exactly the blocks that
:class:`ucm.sparse.triton_select.TritonSelector` chose (its ``out`` rows, ``phys * Hkv + h``).

Split-K flash decoding: each (request, KV head) spreads its kept blocks over ``splits`` programs,
each an online softmax over its share for the group's query heads at once (one matrix product per
block: the group's rows padded to 16 against the block's tokens); a second kernel merges the
splits' maxima, sums and outputs. Shapes are fixed by the arguments (the kept columns' width, not
the kept counts), so a step can be captured in a CUDA graph. The last logical block of a request is
read up to its length; every other kept block is full.

Tested against attention over exactly the kept blocks in torch (tests/sparse/triton_cases.py), under
``TRITON_INTERPRET=1`` on the CPU and compiled on a GPU where one is. Not wired into a vLLM CUDA
attention backend: only vLLM's CPU build runs here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.sparse.triton_select import check_head_dim, group_query

BLOCKS_PER_SPLIT = 16  # a split reads at least this many blocks before merging costs more than it spreads
MAX_SPLITS = 32


@triton.jit
def _partial(
    query,
    q_token,
    q_head,
    tokens,
    key_cache,
    value_cache,
    s_block,
    s_token,
    s_head,
    rows,
    r_row,
    kept,
    tables,
    t_row,
    seq_lens,
    acc_out,
    stat_out,
    scale,
    block_size,
    per_split,
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    SPLITS: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    t = tl.arange(0, BT)
    seq = tl.load(seq_lens + r)
    n = (seq + block_size - 1) // block_size
    last = tl.load(tables + r * t_row + n - 1).to(tl.int64)  # the one block read only up to seq
    tail = seq - (n - 1) * block_size
    q = group_query(query, q_token, q_head, tokens, r, h, G, GP, D).to(tl.float32) * scale
    m = tl.full((GP,), float("-inf"), tl.float32)
    total = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    first = s * per_split
    stop = tl.minimum(first + per_split, tl.load(kept + r * HKV + h))
    for i in range(first, stop):
        phys = (tl.load(rows + (r * HKV + h) * r_row + i) // HKV).to(tl.int64)
        valid = t < tl.where(phys == last, tail, block_size)
        at = phys * s_block + t[:, None] * s_token + h * s_head + d[None, :]
        k = tl.load(key_cache + at, mask=valid[:, None], other=0.0).to(tl.float32)
        logits = tl.where(valid[None, :], tl.dot(q, tl.trans(k)), float("-inf"))  # (GP, BT)
        top = tl.maximum(m, tl.max(logits, 1))
        p = tl.exp(logits - top[:, None])
        fade = tl.exp(m - top)
        v = tl.load(value_cache + at, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * fade[:, None] + tl.dot(p, v)
        total = total * fade + tl.sum(p, 1)
        m = top
    part = (r * HKV + h) * SPLITS + s
    tl.store(acc_out + (part * GP + g[:, None]) * D + d[None, :], acc)
    tl.store(stat_out + (part * 2) * GP + g, m)
    tl.store(stat_out + (part * 2 + 1) * GP + g, total)


@triton.jit
def _merge(
    acc_in,
    stat_in,
    out,
    o_row,
    o_head,
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    part = (r * HKV + h) * SPLITS + s
    m = tl.load(stat_in + (part[:, None] * 2) * GP + g[None, :])  # (SPLITS, GP); -inf where a split read nothing
    top = tl.max(m, 0)
    total = tl.zeros((GP,), tl.float32)
    result = tl.zeros((GP, D), tl.float32)
    for i in range(SPLITS):  # one split's (GP, D) at a time: all of them at once spill
        at = (r * HKV + h) * SPLITS + i
        mi = tl.load(stat_in + (at * 2) * GP + g)
        weight = tl.where(mi == float("-inf"), 0.0, tl.exp(mi - top))
        total += weight * tl.load(stat_in + (at * 2 + 1) * GP + g)
        result += weight[:, None] * tl.load(acc_in + (at * GP + g[:, None]) * D + d[None, :])
    result = result / total[:, None]
    dest = out + r * o_row + (h * G + g[:, None]) * o_head + d[None, :]
    tl.store(dest, result.to(out.dtype.element_ty), mask=(g < G)[:, None])


def sparse_decode(
    query: torch.Tensor,
    tokens: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows: torch.Tensor,
    kept: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode token per request attending to its kept blocks, per KV head.

    ``query`` (T, Hq, D) and ``tokens`` (R,) int32: request r's query row; ``key_cache`` and
    ``value_cache`` (P, block_size, Hkv, D), vLLM's flash-attention layout (channels contiguous);
    ``rows`` (R * Hkv, W) int32 and ``kept`` (R * Hkv,) int32: the selection's output, blocks as
    ``phys * Hkv + h`` in their first ``kept`` columns; ``tables`` (R, *) and ``seq_lens`` (R,)
    int32. Returns (R, Hq, D) in the query's dtype."""
    requests, hq, dim = len(tokens), query.shape[1], query.shape[2]
    _, block_size, hkv, _ = key_cache.shape
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1:
        raise ValueError("sparse_decode: key and value caches need the same strides, channels contiguous")
    check_head_dim("sparse_decode", dim)
    if rows.stride(1) != 1:
        raise ValueError("sparse_decode: rows need contiguous columns")
    g = hq // hkv
    gp = max(16, triton.next_power_of_2(g))
    width = rows.shape[1]
    splits = triton.next_power_of_2(max(1, min(MAX_SPLITS, triton.cdiv(width, BLOCKS_PER_SPLIT))))
    per_split = triton.cdiv(width, splits)
    acc = torch.empty((requests, hkv, splits, gp, dim), dtype=torch.float32, device=query.device)
    stats = torch.empty((requests, hkv, splits, 2, gp), dtype=torch.float32, device=query.device)
    _partial[(requests, hkv, splits)](
        query,
        query.stride(0),
        query.stride(1),
        tokens,
        key_cache,
        value_cache,
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        rows,
        rows.stride(0),
        kept,
        tables,
        tables.stride(0),
        seq_lens,
        acc,
        stats,
        scale,
        block_size,
        per_split,
        HKV=hkv,
        G=g,
        GP=gp,
        D=dim,
        BT=max(16, triton.next_power_of_2(block_size)),
        SPLITS=splits,
    )
    out = torch.empty((requests, hq, dim), dtype=query.dtype, device=query.device)
    _merge[(requests, hkv)](acc, stats, out, out.stride(0), out.stride(1), HKV=hkv, G=g, GP=gp, D=dim, SPLITS=splits)
    return out
