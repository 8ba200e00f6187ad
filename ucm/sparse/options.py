"""The sparse algorithms' options: pydantic models only, importable without torch (the operator's
image validates ``spec.sparse`` with them and carries no torch)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from ucm.config import StrictModel

if TYPE_CHECKING:
    import torch


def blocks_for_ratio(n: int, ratio: float, min_blocks: int) -> int:
    return min(n, max(min_blocks, math.ceil(ratio * n)))


class TopKConfig(StrictModel):
    """A fixed budget per request and layer: ``sparse_ratio`` of the blocks (at least
    ``min_blocks``), always including the first ``init_window_sz`` blocks (attention sinks) and the
    last ``local_window_sz`` (recent context)."""

    sparse_ratio: float = Field(0.3, gt=0, le=1, description="Share of the blocks attended")
    min_blocks: int = Field(4, ge=1)
    init_window_sz: int = Field(1, ge=0, description="First blocks always attended (attention sinks)")
    local_window_sz: int = Field(2, ge=0, description="Last blocks always attended (recent context)")

    def budget(self, n: int, block_size: int) -> int:
        """Blocks to attend out of ``n``."""
        return blocks_for_ratio(n, self.sparse_ratio, self.min_blocks)

    def windows(self, block_size: int) -> tuple[int, int]:
        """(sink blocks, local blocks)."""
        return self.init_window_sz, self.local_window_sz

    def choose(self, scores: torch.Tensor, block_size: int, shared: bool = False) -> torch.Tensor:
        """The budget's best blocks by ``scores`` (Hkv, n), per KV head. ``shared``: one selection
        for every KV head (scores summed over heads), what a paged attention kernel with one block
        table per request can attend."""
        from ucm.sparse.base import topk_with_windows  # torch, needed only when selecting

        hkv, n = scores.shape
        if shared:
            scores = scores.sum(0, keepdim=True)
        sink, local = self.windows(block_size)
        chosen = topk_with_windows(scores, self.budget(n, block_size), sink, local)
        return chosen.expand(hkv, -1) if shared else chosen


class ESAConfig(TopKConfig):
    retrieval_stride: int = Field(1, ge=1, description="Decode steps a selection is reused for")
    background: bool = Field(False, description="Retrieve on a worker thread, one query behind (offline only)")


class GSAConfig(TopKConfig):
    pass


class GSAOnDeviceConfig(TopKConfig):
    """UCM's token budgets (``hash_topk_tokens``, ``sink_token``, ``recent_token``) replace the block
    ones when given; they are rounded up to whole blocks, so at least those tokens are attended."""

    hash_bits: int | None = Field(None, ge=8, description="Sign bits per key and query; default and maximum: head_dim")
    seed: int = 0
    hash_topk_tokens: int | None = Field(None, ge=1, description="A fixed budget in tokens instead of sparse_ratio")
    sink_token: int | None = Field(None, ge=0, description="Sink window in tokens (instead of init_window_sz)")
    recent_token: int | None = Field(None, ge=0, description="Local window in tokens (instead of local_window_sz)")

    @model_validator(mode="after")
    def _bits(self) -> GSAOnDeviceConfig:
        if self.hash_bits is not None and self.hash_bits % 8:
            raise ValueError(f"hash_bits: must be a multiple of 8 (bits are packed in bytes), got {self.hash_bits}")
        return self

    def budget(self, n: int, block_size: int) -> int:
        if self.hash_topk_tokens is None:
            return super().budget(n, block_size)
        return min(n, max(self.min_blocks, -(-self.hash_topk_tokens // block_size)))

    def windows(self, block_size: int) -> tuple[int, int]:
        sink = self.init_window_sz if self.sink_token is None else -(-self.sink_token // block_size)
        local = self.local_window_sz if self.recent_token is None else -(-self.recent_token // block_size)
        return sink, local


class KVStarConfig(TopKConfig):
    retrieval_stride: int = Field(4, ge=1, description="Decode steps a selection is reused for")
    blk_repre_dim_prune_ratio: float = Field(1.0, gt=0, le=1, description="Share of key channels kept in scores")
    store_dtype: Literal["float16", "bfloat16", "float32"] = "float16"

    def keep_dims(self, head_dim: int) -> int | None:
        """Channels kept, None for all."""
        return None if self.blk_repre_dim_prune_ratio >= 1 else max(1, round(head_dim * self.blk_repre_dim_prune_ratio))


class PSAConfig(StrictModel):
    eps: float = Field(0.95, gt=0, le=1, description="Attention mass to reach before stopping (1: every block)")
    microbatch: int = Field(4, ge=1, description="Blocks attended between two stopping checks")
    init_window_sz: int = Field(1, ge=0, description="First blocks attended first, whatever their bound")
    local_window_sz: int = Field(2, ge=0, description="Last blocks attended first too (recent context)")
