"""Blend's attention over vLLM's paged CPU cache (``PagedAttention``: vLLM's own cache writer and
kernel) against the reference SDPA with an explicit mask, for the query positions a blend runs:
a computed prefix, then runs and scattered picks (a kernel row each), over a block table out of order.

Merging nearby runs into one row (queries of zeros in the gaps) was tried and measured slower on
SmolLM2's shapes (2,800 tokens, 564 queries: 337 rows 96 ms, 23 rows 194 ms, one row 192 ms): the
kernel's cost follows queries x keys, not rows."""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops

from ucm.integration.vllm.blend import Blender, PagedAttention, sdpa_attention
from ucm.integration.vllm.config import BlendConfig
from ucm.integration.vllm.layout import KVLayout
from ucm.integration.vllm.staging import StagingPool
from ucm.integration.vllm.stats import StatsRecorder

BS, KV_HEADS, HEADS, DIM = 32, 2, 4, 64


def test_paged_attention_equals_the_masked_reference():
    g = torch.Generator().manual_seed(0)
    blocks, m, computed = 12, 300, 40
    cache = torch.zeros(blocks, KV_HEADS, BS, 2 * DIM)
    layout = KVLayout({"model.layers.0.self_attn.attn": cache}, blocks)
    blender = Blender(
        BlendConfig(),
        layout,
        store=None,  # type: ignore[arg-type]  # attention reads no store
        rank=0,
        tp_size=1,
        stats=StatsRecorder(),
        load_timeout_s=None,
        model=lambda: None,
        staging=StagingPool(layout.new_staging, 0),
    )
    block_ids = [5, 2, 7, 0, 9, 3, 1, 8, 11, 4]  # not in order: the block table is followed
    keys = torch.randn(m, KV_HEADS, DIM, generator=g)
    values = torch.randn(m, KV_HEADS, DIM, generator=g)
    # the computed prefix is already in the cache (as vLLM's loads put it)
    prefix = torch.arange(computed)
    slots = torch.tensor(block_ids)[prefix // BS] * BS + prefix % BS
    ops.cpu_attn_reshape_and_cache(keys[:computed], values[:computed], *blender.caches(0), slots, blender.isa)
    picked = [97, 100, 101, 130, 131, 132, 170, 250]
    positions = torch.tensor([*range(computed, 80), *picked, *range(280, m)])
    q = torch.randn(positions.numel(), HEADS, DIM, generator=g)
    scale = DIM**-0.5
    out = PagedAttention(blender, block_ids, computed, m)(0, q, keys, values, positions, scale)
    expected = sdpa_attention(0, q, keys, values, positions, scale)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
