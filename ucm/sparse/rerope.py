"""ReRoPE: rectified rotary positions, for contexts longer than the model was trained on.

Inside a window ``w`` attention uses ordinary RoPE (relative distance i - j); beyond it the
distance is clamped to ``w``, so no query ever sees a relative position larger than it was trained
with. Computed as two score sets — RoPE'd query and keys, and the query rotated by ``w`` against
unrotated keys (a relative distance of exactly ``w``) — merged by the window mask.
"""

from __future__ import annotations

import math

import torch

from ucm.sparse.rope import apply_rope


def rerope_attention(
    q: torch.Tensor, q_pos: int, keys: torch.Tensor, values: torch.Tensor, window: int, base: float = 10000.0
) -> torch.Tensor:
    """One query (H, D) at ``q_pos`` over unrotated keys/values (N, Hkv, D) at positions 0..N-1."""
    n, hkv, d = keys.shape
    positions = torch.arange(n, device=keys.device)
    qg = q.view(hkv, -1, d)  # (Hkv, G, D): the query heads sharing each KV head
    q_rot = apply_rope(qg, torch.full((hkv,), q_pos, device=q.device), base)
    k_rot = apply_rope(keys, positions, base)
    inside = torch.einsum("hgd,nhd->hgn", q_rot, k_rot)
    q_far = apply_rope(qg, torch.full((hkv,), window, device=q.device), base)
    outside = torch.einsum("hgd,nhd->hgn", q_far, keys)  # relative distance exactly `window`
    near = (q_pos - positions) < window
    logits = torch.where(near, inside, outside) / math.sqrt(d)
    logits = logits.masked_fill(positions > q_pos, float("-inf"))
    return torch.einsum("hgn,nhd->hgd", torch.softmax(logits, -1), values).reshape(q.shape)
