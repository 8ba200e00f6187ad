"""Rotary position embeddings (the rotate-half form Llama uses), as plain functions."""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """(T,) positions -> (T, dim/2) angles."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    return positions.to(torch.float64)[:, None] * inv_freq[None, :]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate ``x`` (T, ..., D) by its positions (T,)."""
    d = x.shape[-1]
    ang = rope_angles(positions, d, base)
    shape = (ang.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x[..., : d // 2].double(), x[..., d // 2 :].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
