"""PSA, progressive sparse attention: attend blocks in order of an upper bound on their scores,
microbatch by microbatch, and stop as soon as what is left cannot matter much.

A block's criticality bound for a query is the smaller of two upper bounds on every ``q . k`` in
the block: the box bound ``sum_d max(q_d * kmax_d, q_d * kmin_d)`` (elementwise key extremes) and
the ball bound ``q . mean + |q| * radius`` (keys within ``radius`` of the block mean), both from
:class:`BlockMeta`. In many dimensions the box bound is loose and noisy; the ball bound's slack is
nearly the same for every block, so it orders blocks by ``q . mean``.

Blocks are taken in decreasing bound order — the sink and local windows first, whatever their
bound (recent context carries a language model) — ``m`` at a time; partial outputs merge with the exact
online-softmax rule (running max, rescaled sums). After each microbatch, with ``AS_acc`` the score
mass attended so far and ``AS_min`` the smallest block mass met so far, a query head is done when
``AS_acc / (AS_acc + AS_min * N_left) >= eps``: even if every remaining block were as heavy as the
lightest seen, they would hold at most ``1 - eps`` of the mass. A KV head's group stops when all
its query heads are done, so the budget adapts per query and layer. With ``eps = 1`` every block
is attended and the result is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ucm.sparse.base import BlockMeta, BlockSelector, PagedKV, group_query
from ucm.sparse.options import PSAConfig


@dataclass
class OnlineSoftmax:
    """Running state of softmax attention over token sets seen so far, per (Hkv, G) head."""

    m: torch.Tensor  # running max logit
    s: torch.Tensor  # sum of exp(logit - m)
    o: torch.Tensor  # sum of exp(logit - m) * v, (Hkv, G, D)

    @classmethod
    def empty(cls, hkv: int, g: int, d: int, device: torch.device, dtype: torch.dtype) -> OnlineSoftmax:
        return cls(
            torch.full((hkv, g), float("-inf"), device=device, dtype=dtype),
            torch.zeros(hkv, g, device=device, dtype=dtype),
            torch.zeros(hkv, g, d, device=device, dtype=dtype),
        )

    def add(self, logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Merge logits (Hkv, G, T) with values (Hkv, T, D); returns the rescale factor of old sums."""
        m_new = torch.maximum(self.m, logits.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        scale = torch.exp(self.m - safe)
        scale = torch.where(torch.isinf(self.m), torch.zeros_like(scale), scale)
        p = torch.exp(logits - safe[..., None])
        self.s = self.s * scale + p.sum(-1)
        self.o = self.o * scale[..., None] + torch.einsum("hgt,htd->hgd", p, v)
        self.m = m_new
        return scale

    def result(self) -> torch.Tensor:
        return self.o / self.s[..., None]


def upper_bounds(q: torch.Tensor, meta: BlockMeta) -> torch.Tensor:
    """Per (Hkv, G) query head and block, an upper bound of q . k over the block: (Hkv, G, n)."""
    hkv = meta.kmax.shape[1]
    qg = group_query(q, hkv)  # (Hkv, G, D)
    hi = torch.einsum("hgd,nhd->hgnd", qg, meta.kmax)
    lo = torch.einsum("hgd,nhd->hgnd", qg, meta.kmin)
    box = torch.maximum(hi, lo).sum(-1)
    ball = torch.einsum("hgd,nhd->hgn", qg, meta.mean) + qg.norm(dim=-1)[..., None] * meta.radius.T[:, None, :]
    return torch.minimum(box, ball)


class PSA(BlockSelector):
    def __init__(self, config: PSAConfig | None = None) -> None:
        self.config = config or PSAConfig()

    def attend(self, q: torch.Tensor, kv: PagedKV, meta: BlockMeta, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Output (H, D) and the number of blocks each KV head attended (Hkv,)."""
        c = self.config
        meta.update(kv)
        hkv, d, b = kv.keys.shape[2], kv.keys.shape[3], kv.block_size
        qg = group_query(q, hkv)
        g = qg.shape[1]
        n = kv.num_blocks
        bounds = upper_bounds(q, meta).amax(1)  # (Hkv, n): a block's bound for its most eager query head
        bounds[:, : min(c.init_window_sz, n)] = float("inf")
        if c.local_window_sz:
            bounds[:, max(0, n - c.local_window_sz) :] = float("inf")
        order = torch.argsort(bounds, dim=-1, descending=True)  # (Hkv, n)
        # The windows are attended whatever their mass: they say nothing about the blocks left.
        forced = torch.gather(torch.isinf(bounds), 1, order)  # (Hkv, n), in attention order
        state = OnlineSoftmax.empty(hkv, g, d, q.device, q.dtype)
        acc_min = torch.full((hkv, g), float("inf"), device=q.device, dtype=q.dtype)
        active = torch.ones(hkv, dtype=torch.bool, device=q.device)
        used = torch.zeros(hkv, dtype=torch.long, device=q.device)
        heads = torch.arange(hkv, device=q.device)[:, None]
        scale = 1.0 / math.sqrt(d)
        for start in range(0, n, c.microbatch):
            blocks = order[:, start : start + c.microbatch]  # (Hkv, m)
            m = blocks.shape[1]
            phys = kv.block_table[blocks]
            k_sel = kv.keys[phys, :, heads, :].reshape(hkv, m * b, d).to(q.dtype)
            v_sel = kv.values[phys, :, heads, :].reshape(hkv, m * b, d).to(q.dtype)
            logits = torch.einsum("hgd,htd->hgt", qg, k_sel) * scale
            pos = (blocks[:, :, None] * b + torch.arange(b, device=q.device)).reshape(hkv, 1, -1)
            logits = logits.masked_fill(pos >= kv.num_tokens, float("-inf"))
            logits = logits.masked_fill(~active[:, None, None], float("-inf"))  # finished heads take nothing
            rescale = state.add(logits, v_sel)
            # Block masses in the current (rescaled) units, for the stopping rule; a partly filled block
            # counted as if full, and the forced windows not at all.
            block_mass = torch.exp(logits - state.m[..., None]).view(hkv, g, m, b).sum(-1)  # (Hkv, G, m)
            filled = (pos < kv.num_tokens).view(hkv, m, b).sum(-1).clamp(min=1)  # (Hkv, m)
            block_mass = block_mass * (b / filled)[:, None, :]
            block_mass = block_mass.masked_fill(forced[:, None, start : start + m], float("inf"))
            lightest = block_mass.amin(-1)
            # (the first merge rescales by 0: inf * 0 would be NaN and the rule would never stop)
            acc_min = torch.where(torch.isinf(acc_min), lightest, torch.minimum(acc_min * rescale, lightest))
            used += active.long() * m
            left = n - (start + m)
            if left <= 0:
                break
            ratio = state.s / (state.s + acc_min * left)
            done = (ratio >= c.eps).all(-1)  # every query head of the group
            active &= ~done
            if not active.any():
                break
        used = used.clamp(max=n)
        self.last_blocks = [row[:u] for row, u in zip(order, used.tolist(), strict=True)]
        return state.result().reshape(q.shape), used
