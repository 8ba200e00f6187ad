"""Block selection on GPUs, in Triton: the scores and the choice of the native kernel
(:mod:`ucm.sparse.summaries`) for the ``mean``, ``bound`` and ``both`` scorings, with fixed shapes
(no host synchronisation, no data-dependent allocation: capturable in a CUDA graph).

On a GPU the summaries are not folded key by key as on the CPU: a block's summary is recomputed
from the paged cache whenever the block changes (:meth:`TritonSelector.summarize`, one program per
(block, KV head) reading ``block_size x head_dim`` values), which costs the same as the write itself
and needs no running state (the mean's running sum, lo/hi) and no ordering between writers.

Scoring is a Triton kernel per (request, KV head, group of blocks): each query head of the group
against each block's representation, written as logits. The softmax over blocks, the sum over the
group, the windows and the top-k are a few fixed-shape torch operations on those logits. The hash
scoring (GSA on-device) and KVStar's channel pruning are not ported (the constructor says so).

Tested under ``TRITON_INTERPRET=1`` on the CPU against the native kernel and the plain-torch
reference (tests/sparse/test_triton.py); it has not run on a GPU here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.sparse.summaries import MODES, REP_ROWS, Scoring

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
    count,
    MODE: tl.constexpr,
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
        tl.store(out + first * r_row, ((lo + hi) * 0.5).to(rep.dtype.element_ty))
        tl.store(out + (first + 1) * r_row, ((hi - lo) * 0.5).to(rep.dtype.element_ty))
    if h == 0:
        tl.store(count + p, n)


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
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2) * BN + tl.arange(0, BN)
    n = (tl.load(seq_lens + r) + block_size - 1) // block_size
    held = j < n
    phys = tl.load(tables + r * t_row + j, mask=held, other=0).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    row = tl.load(tokens + r).to(tl.int64)
    q = tl.load(query + row * q_token + (h * G + g)[:, None] * q_head + d[None, :], mask=(g < G)[:, None], other=0.0)
    q = q.to(tl.float32)
    base = rep + phys[:, None] * r_block + h * r_head + d[None, :]
    dest = out + r * o_row + h * o_head + g[:, None] * o_q + j[None, :]
    keep = (g < G)[:, None] & held[None, :]
    if MODE == 1 or MODE == 3:  # q . mean
        mean = tl.load(base, mask=held[:, None], other=0.0).to(tl.float32)
        tl.store(dest, tl.sum(q[:, None, :] * mean[None, :, :], 2), mask=keep)
    if MODE == 0 or MODE == 3:  # Quest's bound: q . c + |q| . r
        first = 0 if MODE == 0 else 1
        c = tl.load(base + first * r_row, mask=held[:, None], other=0.0).to(tl.float32)
        rad = tl.load(base + (first + 1) * r_row, mask=held[:, None], other=0.0).to(tl.float32)
        bound = tl.sum(q[:, None, :] * c[None, :, :] + tl.abs(q)[:, None, :] * rad[None, :, :], 2)
        second = 1 if MODE == 3 else 0  # the bound is the second estimate beside the mean
        tl.store(dest + second * o_est, bound, mask=keep)


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
        if head_dim & (head_dim - 1):
            raise ValueError(f"triton selection: head_dim must be a power of two, got {head_dim}")
        self.scoring = scoring
        self.block_size, self.kv_heads, self.head_dim = block_size, kv_heads, head_dim
        self.dtype = scoring.dtype or torch.bfloat16
        self.rep = torch.zeros(num_blocks, kv_heads, REP_ROWS[scoring.mode], head_dim, dtype=self.dtype, device=device)
        self.count = torch.zeros(num_blocks, dtype=torch.int32, device=device)

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
            self.count,
            MODE=MODES[self.scoring.mode],
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
        gp = max(2, triton.next_power_of_2(g))
        logits = torch.full((rows, hkv, estimates, gp, width), float("-inf"), device=query.device)
        bn = min(64, triton.next_power_of_2(width))
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
            logits,
            logits.stride(0),
            logits.stride(1),
            logits.stride(2),
            logits.stride(3),
            self.block_size,
            G=g,
            GP=gp,
            D=self.head_dim,
            BN=bn,
            MODE=MODES[self.scoring.mode],
        )
        t = self.scoring.temperature(self.head_dim, scale)
        share = torch.softmax(logits[:, :, :, :g] * t, -1).nan_to_num(0.0)  # rows of -inf: no blocks
        group = share.mean(2).sum(2)  # (R, Hkv, W): each block's estimated share of the group's attention
        if prior is not None:  # by physical block and KV head
            group = group + prior[tables.long()].permute(0, 2, 1)
        cols = torch.arange(width, device=query.device)
        n = ((seq_lens.long() + self.block_size - 1) // self.block_size)[:, None, None]
        held = cols < n
        if scores is not None:
            shown = min(width, scores.shape[1])
            scores.view(rows, hkv, -1)[:, :, :shown] = torch.where(held, group, 0.0)[:, :, :shown]
        sink, local = windows
        window = held & ((cols < sink) | (cols >= n - local))
        rank_by = torch.where(window, float("inf"), torch.where(held, group, float("-inf")))
        order = torch.sort(rank_by, dim=-1, descending=True, stable=True).indices  # ties: lower block first
        limit = budget.long()[:, None].expand(rows, hkv)
        if mass > 0:  # the windows, then best first until the share taken reaches `mass` per query head
            ranked = group.gather(-1, order)
            before = ranked.cumsum(-1) - ranked
            take = (window.expand_as(order).gather(-1, order) | (before < mass * g)) & held.expand_as(order)
            limit = torch.minimum(take.sum(-1), limit).clamp(min=1)
        rank = torch.empty_like(order).scatter_(-1, order, cols.expand_as(order))
        chosen = rank < limit[..., None]
        columns = min(width, out.shape[1])  # at most the largest budget
        logical = torch.sort(torch.where(chosen, cols, width + cols), dim=-1).values[..., :columns] % width
        phys = tables.long()[:, None, :].expand(rows, hkv, width).gather(-1, logical)  # ascending, kept first
        heads_of = torch.arange(hkv, device=query.device)[None, :, None]
        target = out.view(rows, hkv, -1)[:, :, :columns]
        fill = cols[:columns] < limit[..., None]
        target.copy_(torch.where(fill, (phys * hkv + heads_of).to(torch.int32), target))
        if kept is not None:
            kept.copy_(limit.reshape(-1).to(torch.int32))
