"""Block selection on GPUs, in Triton: the scores and the choice of the native kernel
(:mod:`ucm.sparse.summaries`) for the ``mean``, ``bound`` and ``both`` scorings, the bound also from
int8 bytes (GSA's default), with fixed shapes (no host synchronisation, no data-dependent
allocation: capturable in a CUDA graph).

On a GPU the summaries are not folded key by key as on the CPU: a block's summary is recomputed
from the paged cache whenever the block changes (:meth:`TritonSelector.summarize`, one program per
(block, KV head) reading ``block_size x head_dim`` values), which costs the same as the write itself
and needs no running state (the mean's running sum, lo/hi) and no ordering between writers.

Selection is two Triton kernels. The first, per (request, KV head, group of blocks), scores each
query head of the group against each block's representation as matrix products (logits). The
second, per (request, KV head), takes the softmax over blocks, sums the group's shares, adds the
prior, forces the windows and keeps the top blocks: the k-th score by bisection over the scores'
bits (32 counts), ties going to the lower block as in the native kernel; with an adaptive budget a
sort of the scores gives the count. Measured on an H200 (benchmarks/gpu_paths.py): the same steps as
~40 torch operations took ~1 ms per layer whatever the context (launches), a bitonic sort of 4,096
blocks as much as the rest, and a broadcast product in place of tl.dot spilled registers.

The int8 bound is the native kernel's arithmetic: the same quantization of [c | r] in summarize and
of the query per head in the logits, whose dot products are whole numbers below 2^24 (|c_q|, |q8|
<= 127, r_q <= 255) and so exact as float32 products on TF32 tensor cores; the logits are then the
native kernel's bits, the bytes read half the bfloat16 bound's. (A GPU has not run it yet.) The hash
scoring (GSA on-device) and KVStar's channel pruning are not ported (the constructor says so).

Tested against the native kernel and the plain-torch reference (tests/sparse/test_triton.py) under
``TRITON_INTERPRET=1`` on the CPU, and compiled on a GPU where one is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.sparse.summaries import MODES, QUANTIZED, REP_ROWS, Scoring

ESTIMATES = {"mean": 1, "bound": 1, "both": 2}  # softmaxes averaged per query head


@triton.jit
def _summarize(
    cache,
    s_block,
    s_token,
    s_head,
    blocks,
    fills,
    rep,
    r_block,
    r_head,
    r_row,
    rep_scale,
    count,
    MODE: tl.constexpr,
    QUANT: tl.constexpr,
    BT: tl.constexpr,
    D: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.load(blocks + i).to(tl.int64)
    n = tl.load(fills + i)
    t = tl.arange(0, BT)
    d = tl.arange(0, D)
    present = t[:, None] < n
    keys = tl.load(cache + p * s_block + t[:, None] * s_token + h * s_head + d[None, :], mask=present, other=0.0)
    keys = keys.to(tl.float32)
    out = rep + p * r_block + h * r_head + d
    if MODE == 1 or MODE == 3:  # the mean key first
        tl.store(out, (tl.sum(keys, 0) / n).to(rep.dtype.element_ty))
    if MODE == 0 or MODE == 3:  # then [c | r] of the per-channel extremes
        first = 0 if MODE == 0 else 1
        lo = tl.min(tl.where(present, keys, float("inf")), 0)
        hi = tl.max(tl.where(present, keys, float("-inf")), 0)
        centre, radius = (lo + hi) * 0.5, (hi - lo) * 0.5
        if QUANT:  # as the native kernel's quantize_bound: the centre to nearest, its error into the radius
            scale = tl.maximum(
                tl.math.div_rn(tl.max(tl.abs(centre), 0), 127.0), tl.math.div_rn(tl.max(radius, 0), 254.0)
            )
            inv = tl.where(scale > 0, tl.math.div_rn(1.0, scale), 0.0)
            cq = tl.minimum(tl.maximum(_rint(centre * inv), -127.0), 127.0)
            rq = tl.minimum(tl.ceil((radius + tl.abs(centre - scale * cq)) * inv), 255.0)
            tl.store(out, (cq + 128.0).to(tl.uint8))
            tl.store(out + r_row, rq.to(tl.uint8))
            tl.store(rep_scale + p * tl.num_programs(1) + h, scale)
        else:
            tl.store(out + first * r_row, centre.to(rep.dtype.element_ty))
            tl.store(out + (first + 1) * r_row, radius.to(rep.dtype.element_ty))
    if h == 0:
        tl.store(count + p, n)


@triton.jit
def _rint(x):
    """x rounded to the nearest whole number, ties to even (C's nearbyint; libdevice's rint does not
    run under the interpreter): x - floor(x) is exact, so the tie is seen exactly."""
    down = tl.floor(x)
    frac = x - down
    odd = (down.to(tl.int32) & 1) == 1
    return down + ((frac > 0.5) | ((frac == 0.5) & odd)).to(tl.float32)


@triton.jit
def _quantize_query(q):
    """(GP, D) float32 query heads as int8 values (in float32) per head, and each head's scale: the
    native kernel's quantize_query."""
    top = tl.max(tl.abs(q), 1)
    inv = tl.where(top > 0, tl.math.div_rn(127.0, top), 0.0)
    q8 = tl.minimum(tl.maximum(_rint(q * inv[:, None]), -127.0), 127.0)
    return q8, tl.math.div_rn(top, 127.0)


def check_head_dim(who: str, head_dim: int) -> None:
    """The kernels' matrix products take a power of two from 16 as a side."""
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"{who}: head_dim must be a power of two from 16, got {head_dim}")


@triton.jit
def group_query(query, q_token, q_head, tokens, r, h, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """(GP, D): request r's query heads sharing KV head h, the rows past G zero (a matrix product's
    rows are at least 16)."""
    g = tl.arange(0, GP)
    token = tl.load(tokens + r).to(tl.int64)
    at = query + token * q_token + (h * G + g)[:, None] * q_head + tl.arange(0, D)[None, :]
    return tl.load(at, mask=(g < G)[:, None], other=0.0)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b of float32 operands. Values that came from bfloat16 or float16 are exact in TF32, the
    tensor cores' input; float32 representations ask for IEEE products. (Not bfloat16 operands:
    Triton's interpreter multiplies them wrongly.)"""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _logits(
    query,
    q_token,
    q_head,
    tokens,
    tables,
    t_row,
    seq_lens,
    rep,
    r_block,
    r_head,
    r_row,
    rep_scale,
    out,
    o_row,
    o_head,
    o_est,
    o_q,
    block_size,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BN: tl.constexpr,
    MODE: tl.constexpr,
    QUANT: tl.constexpr,
    IEEE: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2) * BN + tl.arange(0, BN)
    n = (tl.load(seq_lens + r) + block_size - 1) // block_size
    held = j < n
    phys = tl.load(tables + r * t_row + j, mask=held, other=0).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = group_query(query, q_token, q_head, tokens, r, h, G, GP, D)
    base = rep + phys[:, None] * r_block + h * r_head + d[None, :]
    dest = out + r * o_row + h * o_head + g[:, None] * o_q + j[None, :]
    keep = (g < G)[:, None] & held[None, :]
    if QUANT:  # the bound from bytes [c_q + 128 | r_q]: whole numbers, exact in TF32 and in the sums
        q8, q_scale = _quantize_query(q.to(tl.float32))
        c = tl.load(base, mask=held[:, None], other=128).to(tl.float32) - 128.0
        rad = tl.load(base + r_row, mask=held[:, None], other=0).to(tl.float32)
        dots = _dot(q8, tl.trans(c), False) + _dot(tl.abs(q8), tl.trans(rad), False)
        block_scale = tl.load(rep_scale + phys * tl.num_programs(1) + h, mask=held, other=0.0)
        tl.store(dest, dots * block_scale[None, :] * q_scale[:, None], mask=keep)
    else:
        q = q.to(rep.dtype.element_ty).to(tl.float32)  # in the representations' precision
        if MODE == 1 or MODE == 3:  # q . mean
            mean = tl.load(base, mask=held[:, None], other=0.0).to(tl.float32)
            tl.store(dest, _dot(q, tl.trans(mean), IEEE), mask=keep)
        if MODE == 0 or MODE == 3:  # Quest's bound: q . c + |q| . r
            first = 0 if MODE == 0 else 1
            c = tl.load(base + first * r_row, mask=held[:, None], other=0.0).to(tl.float32)
            rad = tl.load(base + (first + 1) * r_row, mask=held[:, None], other=0.0).to(tl.float32)
            bound = _dot(q, tl.trans(c), IEEE) + _dot(tl.abs(q), tl.trans(rad), IEEE)
            second = 1 if MODE == 3 else 0  # the bound is the second estimate beside the mean
            tl.store(dest + second * o_est, bound, mask=keep)


@triton.jit
def _choose(
    logits,
    l_row,
    l_head,
    l_est,
    l_q,
    tables,
    t_row,
    seq_lens,
    budget,
    prior,
    scores,
    s_row,
    shown,
    out,
    o_row,
    columns,
    kept,
    temperature,
    target,
    sink,
    local,
    block_size,
    width,
    G: tl.constexpr,
    E: tl.constexpr,
    WP: tl.constexpr,
    HAS_PRIOR: tl.constexpr,
    HAS_SCORES: tl.constexpr,
    ADAPTIVE: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    hkv = tl.num_programs(1)
    c = tl.arange(0, WP)
    inside = c < width
    n = (tl.load(seq_lens + r) + block_size - 1) // block_size
    held = c < n
    group = tl.zeros((WP,), tl.float32)
    for e in tl.static_range(E):  # each estimate's softmax over the blocks, per query head
        for j in tl.static_range(G):
            x = tl.load(logits + r * l_row + h * l_head + e * l_est + j * l_q + c, mask=held, other=float("-inf"))
            x = x * temperature
            top = tl.max(x, 0)
            p = tl.where(held, tl.exp(x - tl.where(top == float("-inf"), 0.0, top)), 0.0)
            group += p / tl.maximum(tl.sum(p, 0), 1e-30) / E
    phys = tl.load(tables + r * t_row + c, mask=inside, other=0).to(tl.int64)
    if HAS_PRIOR:  # by physical block and KV head
        group += tl.load(prior + phys * hkv + h, mask=held, other=0.0)
    row = r * hkv + h
    if HAS_SCORES:
        tl.store(scores + row * s_row + c, tl.where(held, group, 0.0), mask=c < shown)
    window = held & ((c < sink) | (c >= n - local))
    limit = tl.load(budget + r)
    if ADAPTIVE:  # the windows, then best first while the share taken before a block is short of target
        rest = tl.sort(tl.where(held & ~window, group, -1.0), 0, descending=True)  # shares are >= 0
        valid = rest >= 0
        before = tl.sum(tl.where(window, group, 0.0), 0) + tl.cumsum(tl.where(valid, rest, 0.0), 0)
        before -= tl.where(valid, rest, 0.0)
        taken = tl.sum(window.to(tl.int32), 0) + tl.sum((valid & (before < target)).to(tl.int32), 0)
        limit = tl.maximum(tl.minimum(taken, limit), 1)
    rank = tl.where(window, float("inf"), tl.where(held, group, float("-inf")))
    bits = rank.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # ordered as the floats are
    key = tl.where(inside, key, -(2**31))  # below every score, -inf's included
    count = tl.minimum(limit, width)
    lo = tl.full((), -(2**31), tl.int64)  # the count-th largest key, by bisection: at most 32 halvings
    hi = tl.full((), 2**31 - 1, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) >> 1
        enough = tl.sum((key >= mid).to(tl.int32), 0) >= count
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = key > lo
    tied = key == lo  # the lowest blocks among those tied at the threshold, as the native kernel
    spare = count - tl.sum(above.to(tl.int32), 0)
    chosen = (above | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= spare))) & inside
    at = tl.cumsum(chosen.to(tl.int32), 0) - 1  # kept blocks in ascending order
    tl.store(out + row * o_row + at, (phys * hkv + h).to(tl.int32), mask=chosen & (at < count) & (at < columns))
    tl.store(kept + row, limit)


class TritonSelector:
    """One layer's block representations on the device, and selection over them."""

    def __init__(
        self,
        scoring: Scoring,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device | str,
    ) -> None:
        if scoring.mode not in REP_ROWS:
            raise ValueError(f"triton selection: scoring {scoring.mode!r} is not ported (mean, bound, both are)")
        if scoring.keep_channels < 1:
            raise ValueError("triton selection: channel pruning (KVStar's blk_repre_dim_prune_ratio < 1) is not ported")
        if scoring.dtype == QUANTIZED and scoring.mode != "bound":
            raise ValueError(f"triton selection: int8 summaries score the bound only, not {scoring.mode!r}")
        check_head_dim("triton selection", head_dim)
        self.scoring = scoring
        self.block_size, self.kv_heads, self.head_dim = block_size, kv_heads, head_dim
        self.dtype = scoring.dtype or torch.bfloat16
        self.rep = torch.zeros(num_blocks, kv_heads, REP_ROWS[scoring.mode], head_dim, dtype=self.dtype, device=device)
        # int8: a scale per block and KV head (as BlockSummaries.rep_scale); otherwise never read
        self.rep_scale = torch.zeros(num_blocks if self.quantized else 1, kv_heads, device=device)
        self.count = torch.zeros(num_blocks, dtype=torch.int32, device=device)

    @property
    def quantized(self) -> bool:
        return self.dtype == QUANTIZED

    def summarize(self, key_cache: torch.Tensor, blocks: torch.Tensor, fills: torch.Tensor) -> None:
        """Recompute ``blocks`` (int32) holding ``fills`` (int32, > 0) tokens each from ``key_cache``
        ((P, block_size, Hkv, D), channels contiguous: vLLM's flash-attention key layout)."""
        if len(blocks) == 0:
            return
        if key_cache.stride(3) != 1:
            raise ValueError("triton selection: the key cache's channels must be contiguous")
        _summarize[(len(blocks), self.kv_heads)](
            key_cache,
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            blocks,
            fills,
            self.rep,
            self.rep.stride(0),
            self.rep.stride(1),
            self.rep.stride(2),
            self.rep_scale,
            self.count,
            MODE=MODES[self.scoring.mode],
            QUANT=self.quantized,
            BT=triton.next_power_of_2(self.block_size),
            D=self.head_dim,
        )

    def select(
        self,
        query: torch.Tensor,
        tokens: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        budget: torch.Tensor,
        windows: tuple[int, int],
        scale: float,
        out: torch.Tensor,
        mass: float = 0.0,
        kept: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        prior: torch.Tensor | None = None,
    ) -> None:
        """What :meth:`ucm.sparse.summaries.BlockSummaries.select` does, with the same arguments."""
        rows, width = len(tokens), tables.shape[1]
        hkv, heads = self.kv_heads, query.shape[1]
        g = heads // hkv
        estimates = ESTIMATES[self.scoring.mode]
        if self.dtype == torch.bfloat16:  # as the native kernel: the query in the representations' precision
            query = query.to(torch.bfloat16)
        logits = torch.empty((rows, hkv, estimates, g, width), device=query.device)  # held columns written
        bn = max(16, min(64, triton.next_power_of_2(width)))  # a matrix product's sides are >= 16
        _logits[(rows, hkv, triton.cdiv(width, bn))](
            query,
            query.stride(0),
            query.stride(1),
            tokens,
            tables,
            tables.stride(0),
            seq_lens,
            self.rep,
            self.rep.stride(0),
            self.rep.stride(1),
            self.rep.stride(2),
            self.rep_scale,
            logits,
            logits.stride(0),
            logits.stride(1),
            logits.stride(2),
            logits.stride(3),
            self.block_size,
            G=g,
            GP=max(16, triton.next_power_of_2(g)),
            D=self.head_dim,
            BN=bn,
            MODE=MODES[self.scoring.mode],
            QUANT=self.quantized,
            IEEE=self.dtype == torch.float32,
        )
        if out.stride(1) != 1 or (scores is not None and scores.stride(1) != 1):
            raise ValueError("triton selection: out and scores need contiguous rows")
        wp = triton.next_power_of_2(width)
        if kept is None:
            kept = torch.empty(rows * hkv, dtype=torch.int32, device=query.device)
        sink, local = windows
        _choose[(rows, hkv)](
            logits,
            logits.stride(0),
            logits.stride(1),
            logits.stride(2),
            logits.stride(3),
            tables,
            tables.stride(0),
            seq_lens,
            budget,
            budget if prior is None else prior.contiguous(),  # (P, Hkv)
            out if scores is None else scores,
            0 if scores is None else scores.stride(0),
            0 if scores is None else min(width, scores.shape[1]),
            out,
            out.stride(0),
            min(width, out.shape[1]),  # at most the largest budget
            kept,
            self.scoring.temperature(self.head_dim, scale),
            mass * g,
            sink,
            local,
            self.block_size,
            width,
            G=g,
            E=estimates,
            WP=wp,
            HAS_PRIOR=prior is not None,
            HAS_SCORES=scores is not None,
            ADAPTIVE=mass > 0,
            num_warps=4 if wp <= 512 else 8 if wp <= 4096 else 16,
        )
