"""Blend: reuse the KV of text chunks wherever they appear, not only as a prefix.

A chunk's keys were cached with RoPE applied at the positions it had then. Placed elsewhere, RoPE
rotations compose, so rotating the cached keys by the position difference gives exactly the keys
computed at the new positions (values carry no position). What RoPE cannot fix is cross-attention:
tokens of a reused chunk never attended to what now precedes them. Blend recomputes the tokens
whose KV deviates most from a fresh computation (measured on one layer, as CacheBlend does) and
keeps the cached KV for the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from ucm.sparse.rope import apply_rope


class Match(Enum):
    FULL = "full"  # every token of the chunk is cached
    PARTIAL = "partial"  # a leading part of the chunk is cached
    NONE = "none"


@dataclass
class CachedChunk:
    tokens: tuple[int, ...]
    keys: torch.Tensor  # (T, Hkv, D), RoPE applied at start..start+T
    values: torch.Tensor
    start: int


def classify(chunk: Sequence[int], cached: Sequence[CachedChunk]) -> tuple[Match, CachedChunk | None, int]:
    """The best cached chunk for ``chunk`` and how many leading tokens it covers."""
    best: CachedChunk | None = None
    best_len = 0
    for c in cached:
        n = 0
        for a, b in zip(chunk, c.tokens, strict=False):
            if a != b:
                break
            n += 1
        if n > best_len:
            best, best_len = c, n
    if best is None:
        return Match.NONE, None, 0
    return (Match.FULL if best_len == len(chunk) else Match.PARTIAL), best, best_len


def correct_positions(keys: torch.Tensor, old_start: int, new_start: int, base: float = 10000.0) -> torch.Tensor:
    """Keys RoPE'd at old_start.. -> the same keys RoPE'd at new_start.. (rotate by the delta)."""
    delta = torch.full((keys.shape[0],), new_start - old_start, device=keys.device)
    return apply_rope(keys, delta, base)


def select_recompute(reused: torch.Tensor, fresh: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices of the ``ratio`` share of tokens whose reused KV deviates most from ``fresh``: (r,)."""
    t = reused.shape[0]
    r = min(t, max(0, round(ratio * t)))
    deviation = (reused.float() - fresh.float()).flatten(1).norm(dim=-1)
    return torch.topk(deviation, r).indices.sort().values


def blend(reused: torch.Tensor, fresh: torch.Tensor, recompute: torch.Tensor) -> torch.Tensor:
    """Reused KV with the ``recompute`` tokens taken from ``fresh``."""
    out = reused.clone()
    out[recompute] = fresh[recompute]
    return out
