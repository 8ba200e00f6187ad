"""The sparse algorithms' options: pydantic models only, importable without torch (the operator's
image validates ``spec.sparse`` with them and carries no torch).

Each top-k algorithm keeps, per request, KV head and layer, ``sparse_ratio`` of the request's blocks
(at least ``min_blocks``), always including the first ``init_window_sz`` blocks (attention sinks)
and the last ``local_window_sz`` (recent context, the block being written among them); what
differs is how blocks are summarized and scored (:meth:`TopKConfig.scoring`, see
:mod:`ucm.sparse.summaries`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from ucm.config import StrictModel

if TYPE_CHECKING:
    import torch

    from ucm.sparse.summaries import Scoring


def blocks_for_ratio(n: int, ratio: float, min_blocks: int) -> int:
    return min(n, max(min_blocks, math.ceil(ratio * n)))


class TopKConfig(StrictModel):
    sparse_ratio: float = Field(0.3, gt=0, le=1, description="Share of the blocks attended")
    min_blocks: int = Field(4, ge=1, description="Fewest blocks attended")
    init_window_sz: int = Field(1, ge=0, description="First blocks always attended (attention sinks)")
    local_window_sz: int = Field(2, ge=0, description="Last blocks always attended (recent context)")
    observation_window: int = Field(
        1,
        ge=0,
        description="Last prompt tokens whose attention, computed exactly at the end of the prompt, is added to "
        "every decode step's block scores (SnapKV's observation window; 0: off). 1, the last token: what a PD "
        "decode engine computes itself",
    )
    retrieval_stride: int = Field(
        1, ge=1, description="Decode steps a selection is reused for (the block being written is added meanwhile)"
    )

    def windows(self, block_size: int) -> tuple[int, int]:
        """(sink blocks, local blocks)."""
        return self.init_window_sz, self.local_window_sz

    def budget(self, n: int, block_size: int) -> int:
        """Blocks attended out of ``n`` (the windows at least)."""
        sink, local = self.windows(block_size)
        return min(n, max(blocks_for_ratio(n, self.sparse_ratio, self.min_blocks), sink + local))

    def budget_blocks(self, n: torch.Tensor, block_size: int) -> torch.Tensor:
        """:meth:`budget` of every request of a step at once (``n``: their blocks, long)."""
        import torch

        sink, local = self.windows(block_size)
        ratio = torch.ceil(n.double() * self.sparse_ratio).long()
        return torch.minimum(n, ratio.clamp(min=max(self.min_blocks, sink + local)))


class ESAConfig(TopKConfig):
    """ESA: a block is represented by its mean key and scored by ``q . mean``."""

    def scoring(self, head_dim: int) -> Scoring:
        from ucm.sparse.summaries import Scoring

        return Scoring("mean")


class GSAConfig(TopKConfig):
    """GSA's selection, scored against the query by an upper bound of ``q . k`` over the block from
    each channel's smallest and largest key (Quest's bound); ``block_repre: both`` averages it with
    the mean key's estimate. The bound alone reads two thirds of the bytes per block, which is what
    selection costs at long context (selection 4.5% of a 32k step against 5.4%), with needles no
    worse on SmolLM2 (docs/benchmarks/sparse_serving.md); kept as int8 by default, it reads half of
    that again (selection 2.6 to 2.8% of a 32k step), its needles at 7,000 tokens within 200 paired
    trials of dense (+0.010, interval -0.030 to +0.051). (UCM's design note scores blocks by past
    accesses and position, which cannot see what the current query needs.)"""

    block_repre: Literal["both", "bound"] = Field(
        "bound", description="How blocks are scored: the bound (Quest), or both the bound and the mean key"
    )
    summary_dtype: Literal["bfloat16", "int8"] | None = Field(
        None,
        description="What the bound is scored from: int8 with a scale per block and KV head (half the bytes and dot "
        "products, still an upper bound; block_repre bound only), or bfloat16. Default: int8 with block_repre bound, "
        "bfloat16 with both",
    )

    @model_validator(mode="after")
    def _int8_scores_the_bound(self) -> GSAConfig:
        if self.summary_dtype == "int8" and self.block_repre != "bound":
            raise ValueError("summary_dtype: int8 scores block_repre 'bound' only, got block_repre 'both'")
        return self

    @property
    def quantized(self) -> bool:
        """Whether the bound is scored from int8: asked for, or by default with the bound alone."""
        return self.summary_dtype == "int8" or (self.summary_dtype is None and self.block_repre == "bound")

    def scoring(self, head_dim: int) -> Scoring:
        from ucm.sparse.summaries import QUANTIZED, Scoring

        return Scoring(self.block_repre, dtype=QUANTIZED if self.quantized else None)


class StaticConfig(TopKConfig):
    """The first ``init_window_sz`` blocks and the most recent ones, up to the budget, with no
    scoring at all (StreamingLLM's selection): what any selection costing nothing would run at,
    and so the bound a scored algorithm at the same ``sparse_ratio`` is measured against."""

    retrieval_stride: Literal[1] = Field(1, description="Nothing is retrieved: the selection follows the request")
    observation_window: Literal[0] = Field(0, description="Nothing is scored, so no prompt attention is kept")

    def scoring(self, head_dim: int) -> None:
        return None


class GSAOnDeviceConfig(TopKConfig):
    """UCM's token budgets (``hash_topk_tokens``, ``sink_token``, ``recent_token``) replace the block
    ones when given; they are rounded up to whole blocks, so at least those tokens are attended."""

    hash_bits: int | None = Field(None, ge=8, description="Sign bits per key and query; default and maximum: head_dim")
    seed: int = Field(0, description="Seed of the random rotation the sign bits are taken in")
    hash_topk_tokens: int | None = Field(None, ge=1, description="A fixed budget in tokens instead of sparse_ratio")
    sink_token: int | None = Field(None, ge=0, description="Sink window in tokens (instead of init_window_sz)")
    recent_token: int | None = Field(None, ge=0, description="Local window in tokens (instead of local_window_sz)")

    @model_validator(mode="after")
    def _bits(self) -> GSAOnDeviceConfig:
        if self.hash_bits is not None and self.hash_bits % 8:
            raise ValueError(f"hash_bits: must be a multiple of 8 (bits are packed in bytes), got {self.hash_bits}")
        return self

    def windows(self, block_size: int) -> tuple[int, int]:
        sink = self.init_window_sz if self.sink_token is None else -(-self.sink_token // block_size)
        local = self.local_window_sz if self.recent_token is None else -(-self.recent_token // block_size)
        return sink, local

    def budget(self, n: int, block_size: int) -> int:
        if self.hash_topk_tokens is None:
            return super().budget(n, block_size)
        sink, local = self.windows(block_size)
        return min(n, max(self.min_blocks, -(-self.hash_topk_tokens // block_size), sink + local))

    def budget_blocks(self, n: torch.Tensor, block_size: int) -> torch.Tensor:
        if self.hash_topk_tokens is None:
            return super().budget_blocks(n, block_size)
        import torch

        sink, local = self.windows(block_size)
        return torch.minimum(
            n, n.new_tensor(max(self.min_blocks, -(-self.hash_topk_tokens // block_size), sink + local))
        )

    def scoring(self, head_dim: int) -> Scoring:
        from ucm.sparse.summaries import Scoring

        bits = self.hash_bits or head_dim
        if not 8 <= bits <= head_dim:
            raise ValueError(
                f"hash_bits: must be a multiple of 8 in [8, head_dim={head_dim}] (a rotation of head_dim "
                f"dimensions gives at most head_dim sign bits), got {bits}"
            )
        return Scoring("hash", hash_bits=bits, seed=self.seed)


class KVStarConfig(TopKConfig):
    """KVStar: mean-key representations kept in ``store_dtype`` (float16: half the bytes to score),
    scored over the share ``blk_repre_dim_prune_ratio`` of channels, re-selected every
    ``retrieval_stride`` steps (multi-step retrieval). The channels kept are, per query and KV
    head, those where the group's query weighs most (SparQ's choice): they carry most of ``q . k``."""

    retrieval_stride: int = Field(4, ge=1, description="Decode steps a selection is reused for")
    blk_repre_dim_prune_ratio: float = Field(1.0, gt=0, le=1, description="Share of key channels kept in scores")
    store_dtype: Literal["float16", "bfloat16", "float32"] = Field(
        "float16", description="Dtype the block representations are kept in"
    )

    def scoring(self, head_dim: int) -> Scoring:
        import torch

        from ucm.sparse.summaries import Scoring

        return Scoring("mean", dtype=getattr(torch, self.store_dtype), keep_channels=self.blk_repre_dim_prune_ratio)


class PSAConfig(StrictModel):
    """PSA: an adaptive budget per request, KV head and layer. Blocks are taken best first by their
    estimated share of the attention (each query head's softmax over the blocks' scores, summed
    over the group; scored as GSA's ``block_repre``) until the share taken reaches ``eps``; the
    windows come first. A concentrated head reads a few blocks, a diffuse one many; ``eps = 1``
    reads every block. The bound alone makes a confident estimate that stops early: on SmolLM2's
    activations the mean beside it reaches the same recall with less KV (benchmarks/sparse_eval.py)."""

    eps: float = Field(0.95, gt=0, le=1, description="Estimated attention share to reach before stopping (1: all)")
    max_ratio: float = Field(1.0, gt=0, le=1, description="At most this share of the blocks")
    init_window_sz: int = Field(1, ge=0, description="First blocks attended first, whatever their bound")
    local_window_sz: int = Field(2, ge=0, description="Last blocks attended first too (recent context)")
    block_repre: Literal["both", "bound"] = Field("both", description="How blocks are scored: mean and bound, or bound")

    def windows(self, block_size: int) -> tuple[int, int]:
        return self.init_window_sz, self.local_window_sz

    def budget_blocks(self, n: torch.Tensor, block_size: int) -> torch.Tensor:
        import torch

        cap = torch.ceil(n.double() * self.max_ratio).long()
        return torch.minimum(n, cap.clamp(min=self.init_window_sz + self.local_window_sz))

    def scoring(self, head_dim: int) -> Scoring:
        from ucm.sparse.summaries import Scoring

        return Scoring(self.block_repre, mass=self.eps)
