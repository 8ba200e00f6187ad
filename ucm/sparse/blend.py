"""Blend's selection rule: which reused tokens to recompute.

A chunk's cached KV was computed without what now precedes it; RoPE's part of the difference is
undone exactly by re-rotating its keys (``ucm.integration.vllm.blend.rerotate``), cross-attention's
part is not. CacheBlend's observation: on one early layer, the tokens whose reused KV deviates most
from a fresh computation are few and are the ones that matter; recomputing them through the later
layers recovers most of the quality. The served path is ``ucm.integration.vllm.blend``.
"""

from __future__ import annotations

import torch


def select_recompute(reused: torch.Tensor, fresh: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices of the ``ratio`` share of tokens whose reused KV deviates most from ``fresh``: (r,)."""
    return top_share((reused.float() - fresh.float()).flatten(1).norm(dim=-1), ratio)


def top_share(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices of the ``ratio`` share of ``scores`` (T,) that are largest, ascending: (r,)."""
    return torch.topk(scores, share(scores.shape[0], ratio)).indices.sort().values


def share(total: int, ratio: float) -> int:
    """How many of ``total`` tokens the ``ratio`` share recomputes."""
    return min(total, max(0, round(ratio * total)))
