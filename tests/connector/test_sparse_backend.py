"""The sparse attention backend inside vLLM's CPU kernel: a sparse row attends exactly the blocks
its algorithm chose, dense rows (prefill, short requests) are untouched, and a full budget is the
dense result. The kernel is vLLM's own; the reference is plain torch attention."""

from __future__ import annotations

import math
import types

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, _get_attn_isa

from ucm.integration.vllm.attention import UCMAttentionImpl, UCMAttentionMetadata, learn_layout
from ucm.sparse.base import BlockReader
from ucm.sparse.config import SparseConfig
from ucm.sparse.serving import SparseRuntime

H, HKV, D, B = 4, 2, 64, 32
POOL = 40


def impl() -> UCMAttentionImpl:
    config = VllmConfig()
    # The CPU impl reads only the model's dtype from the current config.
    object.__setattr__(config, "model_config", types.SimpleNamespace(dtype=torch.float32))
    with set_current_vllm_config(config):
        return UCMAttentionImpl(H, D, 1 / math.sqrt(D), HKV, None, None, "auto")


def layer() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        layer_name="model.layers.0.self_attn.attn",
        isa=_get_attn_isa(torch.float32, B, D),
        _k_scale_float=1.0,
        _v_scale_float=1.0,
    )


def batch(seq_lens: list[int], query_lens: list[int], seed: int = 0):
    """Keys and values (in logical layout), a paged cache holding them in the kernel's own layout
    (written by vLLM's cache writer), distinct blocks per request, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, POOL * B, HKV, D, generator=g)
    kv_cache = torch.zeros(POOL, HKV, 2 * B, D)
    key_cache, value_cache = kv_cache.chunk(2, dim=2)
    isa = _get_attn_isa(torch.float32, B, D)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, torch.arange(POOL * B), isa)
    perm = torch.randperm(POOL, generator=g)
    width = max(-(-s // B) for s in seq_lens)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // B)
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    tokens = int(starts[-1])
    query = torch.randn(tokens, H, D, generator=g)
    md = CPUAttentionMetadata(
        num_actual_tokens=tokens,
        max_query_len=max(query_lens),
        query_start_loc=starts,
        max_seq_len=max(seq_lens),
        seq_lens=seq,
        block_table=table,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            len(seq_lens), H, HKV, D, seq, torch.float32, starts, True, -1, isa, False
        ),
    )
    return (keys.view(POOL, B, HKV, D), values.view(POOL, B, HKV, D)), kv_cache.view(POOL, HKV, B, 2 * D), query, md


def reference(natural, q, block_ids: torch.Tensor, blocks: list[int], seq_len: int) -> torch.Tensor:
    """Torch attention of one decode query over exactly ``blocks`` (logical) of a request."""
    keys, values = natural
    k = torch.cat([keys[block_ids[b]] for b in blocks])  # (T, HKV, D)
    v = torch.cat([values[block_ids[b]] for b in blocks])
    valid = torch.cat([torch.arange(B) + b * B < seq_len for b in blocks])
    qg = q.view(HKV, H // HKV, D)
    logits = torch.einsum("hgd,thd->hgt", qg, k) / math.sqrt(D)
    logits = logits.masked_fill(~valid, float("-inf"))
    return torch.einsum("hgt,thd->hgd", torch.softmax(logits, -1), v).reshape(H, D)


def run(config: dict, seq_lens: list[int], query_lens: list[int]):
    natural, kv_cache, query, md = batch(seq_lens, query_lens)
    runtime = SparseRuntime(SparseConfig.model_validate(config), B, HKV, D)
    rows = runtime.begin_step(md.block_table, seq_lens, query_lens)
    chosen: dict[int, list[int]] = {}
    select = runtime.select

    def recording(layer_name, state, q, keys, values, block_ids):
        out = select(layer_name, state, q, keys, values, block_ids)
        chosen[rows.index(state)] = out.blocks.tolist()
        return out

    runtime.select = recording  # type: ignore[method-assign]
    layout = learn_layout(torch.float32, _get_attn_isa(torch.float32, B, D), B, D)
    sparse_md = UCMAttentionMetadata(**vars(md), sparse=runtime, sparse_rows=rows, sparse_layout=layout)
    out = torch.zeros(len(query), H * D)
    impl().forward(layer(), query, query, query, kv_cache, sparse_md, out)
    dense = torch.zeros(len(query), H * D)
    impl().forward(layer(), query, query, query, kv_cache, md, dense)
    return natural, query, md, out.view(-1, H, D), dense.view(-1, H, D), chosen


def test_a_sparse_row_attends_exactly_the_chosen_blocks_and_dense_rows_are_untouched():
    # decode of 300 tokens (10 blocks), a prefill chunk of 5 tokens, a short decode (under min_tokens)
    seq_lens, query_lens = [300, 69, 40], [1, 5, 1]
    config = {"algorithm": "esa", "min_tokens": 64, "esa": {"sparse_ratio": 0.3, "min_blocks": 1}}
    natural, query, md, out, dense, chosen = run(config, seq_lens, query_lens)
    assert list(chosen) == [0]
    blocks = chosen[0]
    assert blocks == sorted(blocks) and blocks[0] == 0 and blocks[-1] == 9  # sink, ..., the block being written
    assert 3 <= len(blocks) < 10
    want = reference(natural, query[0], md.block_table[0].long(), blocks, 300)
    torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out[0], dense[0], atol=1e-3)  # it really skipped blocks
    torch.testing.assert_close(out[1:], dense[1:], rtol=0, atol=0)  # prefill and short rows: vLLM's result


@pytest.mark.parametrize(
    "config",
    [
        {"algorithm": "esa", "esa": {"sparse_ratio": 1.0}},
        {"algorithm": "gsa", "gsa": {"sparse_ratio": 1.0}},
        {"algorithm": "kvstar", "kvstar": {"sparse_ratio": 1.0, "retrieval_stride": 2}},
        {"algorithm": "gsa_ondevice", "gsa_ondevice": {"sparse_ratio": 1.0, "hash_bits": 32}},
        {"algorithm": "psa", "psa": {"eps": 1.0}},
    ],
    ids=lambda c: c["algorithm"],
)
def test_a_full_budget_is_dense_attention(config):
    _, _, _, out, dense, chosen = run({**config, "min_tokens": 1}, [300, 130], [1, 1])
    assert set(chosen) == {0, 1}
    if config["algorithm"] != "psa":
        assert chosen[0] == list(range(10)) and chosen[1] == list(range(5))
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("dtype", "isa"), [(torch.float32, "vec"), (torch.bfloat16, "vec"), (torch.bfloat16, "amx")])
def test_the_kernels_cache_layouts_are_read_back_as_written(dtype, isa):
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: vLLM never uses that layout here")
    keys, values = torch.randn(2, 3 * B, HKV, D).to(dtype)
    cache = torch.zeros(3, HKV, 2 * B, D, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, torch.arange(3 * B), isa)
    key_positions, value_positions = learn_layout(dtype, isa, B, D)
    read_keys = BlockReader(key_cache.flatten(2), key_positions, B, D)
    read_values = BlockReader(value_cache.flatten(2), value_positions, B, D)
    assert torch.equal(read_keys[torch.tensor([2, 0])], keys.view(3, B, HKV, D)[[2, 0]])
    assert torch.equal(read_values[torch.tensor(1), :5], values.view(3, B, HKV, D)[1, :5])


def test_gsa_ondevice_refuses_more_hash_bits_than_head_dim():
    with pytest.raises(ValueError, match=r"sparse.gsa_ondevice.hash_bits: .*head_dim=64"):
        SparseRuntime(
            SparseConfig.model_validate({"algorithm": "gsa_ondevice", "gsa_ondevice": {"hash_bits": 128}}), B, HKV, D
        )
