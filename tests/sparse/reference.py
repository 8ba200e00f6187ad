"""Plain-torch references for the sparse kernels (ucm_native): what a block's summary is, what its
score is, and what attention over exactly the kept blocks gives. Written for clarity, not speed."""

from __future__ import annotations

import math

import torch

from ucm.sparse.summaries import QUANTIZED, Scoring, haar_orthogonal


def summary(scoring: Scoring, keys: torch.Tensor, cache_dtype: torch.dtype, rep_dtype: torch.dtype):
    """One block's summary from its keys (t, Hkv, D): (lo, hi, rep) for bound ((lo, hi, rep, scale)
    quantized), (mean, rep) for mean, (hashes,) for hash — the layout BlockSummaries keeps per block."""
    k = keys.to(cache_dtype).float()
    lo, hi = k.amin(0).to(cache_dtype), k.amax(0).to(cache_dtype)
    c, r = (lo.float() + hi.float()) / 2, (hi.float() - lo.float()) / 2
    mean = k.mean(0)
    if scoring.mode == "bound" and rep_dtype == QUANTIZED:
        return (lo, hi, *quantize_bound(c, r))
    if scoring.mode == "bound":
        return lo, hi, torch.stack([c, r], 1).to(rep_dtype)  # rep: (Hkv, 2, D)
    if scoring.mode == "mean":
        return mean, mean.to(rep_dtype)
    if scoring.mode == "both":
        return lo, hi, mean, torch.stack([mean, c, r], 1).to(rep_dtype)  # rep: (Hkv, 3, D)
    return (hashes(scoring, k),)


def quantize_bound(c: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Centres and radii (Hkv, D) float32 as [c_q + 128 | r_q] (Hkv, 2, D) uint8 and a scale per head:
    the centre rounded to nearest, its error added to the radius, rounded up (a bound stays a bound)."""
    s = torch.maximum(c.abs().amax(-1) / 127, r.amax(-1) / 254)
    inv = torch.where(s > 0, 1 / s, 0)[:, None]
    cq = torch.round(c * inv).clamp(-127, 127)
    rq = torch.ceil((r + (c - s[:, None] * cq).abs()) * inv).clamp(max=255)
    return torch.stack([cq + 128, rq], 1).to(torch.uint8), s


def quantized_bounds(qg: torch.Tensor, rep: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantized bounds (G, n) of query heads qg (G, D) float32 against blocks' [c_q + 128 | r_q] (n, 2,
    D) uint8 with scales (n,): integer dot products against the query quantized per head to int8."""
    top = qg.abs().amax(-1)
    q8 = torch.round(qg * torch.where(top > 0, 127 / top, 0)[:, None]).clamp(-127, 127).long()
    dots = q8 @ rep[:, 0].long().T + q8.abs() @ rep[:, 1].long().T  # (G, n), exact
    return (dots - 128 * q8.sum(-1, keepdim=True)).float() * scale[None, :] * (top / 127)[:, None]


def hashes(scoring: Scoring, x: torch.Tensor) -> torch.Tensor:
    """Sign bits of x @ rotation (..., D) -> (..., bits / 8) uint8, bit i of byte j = column 8j + i."""
    projection = haar_orthogonal(x.shape[-1], scoring.seed)[:, : scoring.hash_bits]
    bits = (x.float() @ projection > 0).to(torch.uint8).view(*x.shape[:-1], -1, 8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def group_scores(
    scoring: Scoring,
    q: torch.Tensor,
    block_summaries: list[tuple[torch.Tensor, ...]],
    fills: list[int],
    h: int,
    hkv: int,
    scale: float,
    rep_dtype: torch.dtype,
) -> torch.Tensor:
    """Each block's estimated share of the attention of KV head ``h``'s query group (summed over the
    group's query heads, each head's softmax over blocks summing to 1): (n,)."""
    heads, d = q.shape
    g = heads // hkv
    qg = q[h * g : (h + 1) * g].float()
    if scoring.mode != "hash" and rep_dtype == torch.bfloat16:
        qg = qg.to(torch.bfloat16).float()
    if scoring.mode == "bound" and rep_dtype == QUANTIZED:
        rep = torch.stack([s[2][h] for s in block_summaries])  # (n, 2, D) uint8
        logits = quantized_bounds(qg, rep, torch.stack([s[3][h] for s in block_summaries]))
    elif scoring.mode in ("bound", "both"):
        rep = torch.stack([s[-1][h] for s in block_summaries]).float()  # (n, 2 or 3, D)
        bound = qg @ rep[:, -2].T + qg.abs() @ rep[:, -1].T
        if scoring.mode == "bound":
            logits = bound
        else:  # two estimates: their softmaxes averaged
            t = scoring.temperature(d, scale)
            mean = qg @ rep[:, 0].T
            both = (torch.softmax(mean.double() * t, 1) + torch.softmax(bound.double() * t, 1)) / 2
            return both.sum(0).float()
    elif scoring.mode == "mean":
        rep = torch.stack([s[1][h] for s in block_summaries]).float().reshape(len(block_summaries), d)
        keep = scoring.keep_channels
        if keep < 1:
            used = max(1, round(keep * d))
            weight = qg.abs().sum(0)
            channels = sorted(sorted(range(d), key=lambda c: (-float(weight[c]), c))[:used])
            qg, rep = qg[:, channels], rep[:, channels]
        logits = qg @ rep.T
    else:
        qh = hashes(scoring, qg)  # (G, W)
        logits = torch.empty(g, len(block_summaries))
        for j, (s, fill) in enumerate(zip(block_summaries, fills, strict=True)):
            keys = s[0][:fill, h]  # (t, W)
            diff = torch.bitwise_xor(qh[:, None, :], keys[None]).numpy()
            bits = torch.tensor([[sum(bin(int(x)).count("1") for x in row) for row in m] for m in diff])
            logits[:, j] = -bits.amin(1).float()
    logits = logits.double() * scoring.temperature(d, scale)
    return torch.softmax(logits, dim=1).sum(0).float()


def attention_over(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax attention of query heads (G, D) over tokens (t, D): (G, D), float64 for a reference."""
    logits = q.double() @ keys.double().T / math.sqrt(q.shape[-1])
    return torch.softmax(logits, dim=-1) @ values.double()
