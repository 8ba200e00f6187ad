"""The sparse attention backend with vLLM's own CPU kernel and cache writer: keys written through the
backend keep their blocks' summaries; a sparse row's KV heads each attend exactly the blocks their
selection names (checked against plain attention over those blocks, per head), the selection
finds the blocks that matter for each head, dense rows (prefill, short requests) and dense layers
are vLLM's result, and a full budget is dense attention."""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.config import KVTransferConfig, VllmConfig, set_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, _get_attn_isa

from tests.sparse.reference import attention_over
from ucm.config import ConfigError
from ucm.integration.vllm.attention import KernelShape, UCMAttentionImpl, learn_layout, sparse_metadata
from ucm.integration.vllm.config import kv_transfer_config
from ucm.sparse.config import SparseConfig
from ucm.sparse.serving import RUNTIMES, SparseRuntime, invalidate_summaries

H, HKV, D, B = 6, 2, 64, 32
G = H // HKV
POOL = 40
SPARSE_LAYER = "model.layers.3.self_attn.attn"
DENSE_LAYER = "model.layers.0.self_attn.attn"
ISA = _get_attn_isa(torch.float32, B, D)


def impl() -> UCMAttentionImpl:
    config = VllmConfig()
    # The CPU impl reads only the model's dtype from the current config.
    object.__setattr__(config, "model_config", types.SimpleNamespace(dtype=torch.float32))
    with set_current_vllm_config(config):
        return UCMAttentionImpl(H, D, 1 / math.sqrt(D), HKV, None, None, "auto")


def layer(name: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(layer_name=name, isa=ISA, _k_scale_float=1.0, _v_scale_float=1.0)


class Batch:
    """Requests with distinct shuffled blocks; their keys written through the backend (so the
    summaries are kept as in serving), some keys planted so that one block per KV head matters."""

    def __init__(
        self, seq_lens: list[int], query_lens: list[int], runtime: SparseRuntime, seed: int = 0, loaded: bool = False
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seq_lens, self.query_lens = seq_lens, query_lens
        self.keys = 0.3 * torch.randn(POOL * B, HKV, D, generator=g)
        self.values = torch.randn(POOL * B, HKV, D, generator=g)
        self.kv_cache = torch.zeros(POOL, HKV, B, 2 * D)
        perm = torch.randperm(POOL, generator=g)
        width = max(-(-s // B) for s in seq_lens)
        self.table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        used = 0
        for i, s in enumerate(seq_lens):
            n = -(-s // B)
            self.table[i, :n] = perm[used : used + n].to(torch.int32)
            used += n
        starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
        self.query = torch.randn(starts[-1], H, D, generator=g)
        # For each decode row, a block per KV head whose key matches that head's queries.
        self.planted: dict[tuple[int, int], int] = {}
        for i, (s, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
            n = -(-s // B)
            if q_len != 1 or n < 6:
                continue
            for h in range(HKV):
                blk = 2 + (3 * h + i) % (n - 4)
                phys = int(self.table[i, blk])
                self.keys[phys * B + 5, h] = 3 * self.query[starts[i], h * G : (h + 1) * G].mean(0)
                self.planted[i, h] = blk
        # Write every request's tokens through the backend, in slot order; or, as a connector load
        # does, with vLLM's cache writer alone, the blocks' summaries then invalidated.
        slots = torch.cat(
            [self.table[i, torch.arange(s) // B].long() * B + torch.arange(s) % B for i, s in enumerate(seq_lens)]
        )
        if loaded:
            key_cache, value_cache = self.kv_cache.view(POOL, HKV, 2 * B, D).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(self.keys[slots], self.values[slots], key_cache, value_cache, slots, ISA)
            invalidate_summaries(torch.unique(slots // B).tolist())
        else:
            for name in (SPARSE_LAYER, DENSE_LAYER):
                impl().do_kv_cache_update(layer(name), self.keys[slots], self.values[slots], self.kv_cache, slots)
        self.metadata = CPUAttentionMetadata(
            num_actual_tokens=starts[-1],
            max_query_len=max(query_lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_seq_len=max(seq_lens),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=self.table,
            slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
            scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
                len(seq_lens),
                H,
                HKV,
                D,
                torch.tensor(seq_lens, dtype=torch.int32),
                torch.float32,
                torch.tensor(starts, dtype=torch.int32),
                True,
                -1,
                ISA,
                False,
            ),
        )
        self.starts = starts

    def reference(self, row: int, h: int, blocks: list[int]) -> torch.Tensor:
        """Plain attention of row ``row``'s query group ``h`` over exactly these logical blocks."""
        s = self.seq_lens[row]
        tokens = torch.cat([torch.arange(b * B, min((b + 1) * B, s)) for b in blocks])
        slots = self.table[row, tokens // B].long() * B + tokens % B
        q = self.query[self.starts[row], h * G : (h + 1) * G]
        return attention_over(q, self.keys[slots, h], self.values[slots, h]).float()


@pytest.fixture(autouse=True)
def _runtimes():
    """The process-wide registry the backend and the connector reach runtimes by, as in an engine
    process; emptied after each test so that no other test's connector sees these runtimes."""
    yield
    RUNTIMES.clear()


def runtime_for(config: dict) -> SparseRuntime:
    layers = [DENSE_LAYER, "model.layers.1.self_attn.attn", SPARSE_LAYER]
    positions = learn_layout(torch.float32, ISA, B, D)[0]
    runtime = SparseRuntime(SparseConfig.model_validate(config), B, HKV, D, layers, key_positions=positions)
    for name in runtime.layer_names:
        RUNTIMES[name] = runtime
    return runtime


def run(
    config: dict,
    seq_lens: list[int],
    query_lens: list[int],
    name: str = SPARSE_LAYER,
    loaded: bool = False,
    before_forward: Callable[[SparseRuntime, Batch], None] | None = None,
):
    """One step of a batch. ``loaded``: the batch's blocks held another batch before, written through
    the backend, and this one's bytes arrive by a connector load. ``before_forward``: what the
    connector does between the step's plan and its forward."""
    runtime = runtime_for(config)
    if loaded:
        Batch(seq_lens, query_lens, runtime, seed=7)
    batch = Batch(seq_lens, query_lens, runtime, loaded=loaded)
    md = batch.metadata
    runtime.begin_step(md.block_table, md.seq_lens - 1, md.query_start_loc)  # the step before: the decodes go on
    plan = runtime.begin_step(md.block_table, md.seq_lens, md.query_start_loc)
    if before_forward is not None:
        before_forward(runtime, batch)
    tables: list[torch.Tensor] = []
    select = runtime.select

    def recording(*args, **kwargs):
        table, lens = select(*args, **kwargs)
        tables.append(table.clone())
        return table, lens

    runtime.select = recording  # type: ignore[method-assign]
    shape = KernelShape(H, HKV, D, torch.float32, ISA, "auto")
    sparse_md = sparse_metadata(md, runtime, plan, learn_layout(torch.float32, ISA, B, D), shape) if plan else md
    out = torch.zeros(len(batch.query), H * D)
    impl().forward(layer(name), batch.query, batch.query, batch.query, batch.kv_cache, sparse_md, out)
    dense = torch.zeros(len(batch.query), H * D)
    impl().forward(layer(name), batch.query, batch.query, batch.query, batch.kv_cache, md, dense)
    return batch, plan, tables, out.view(-1, H, D), dense.view(-1, H, D)


def chosen_blocks(batch: Batch, plan, table: torch.Tensor, row: int, h: int) -> list[int]:
    """The logical blocks the per-head table names for a batch row's KV head."""
    r = plan.rows.tolist().index(row)
    k = int(plan.kept[r])
    phys = (table[r * HKV + h, :k] // HKV).tolist()
    assert all(int(x) % HKV == h for x in table[r * HKV + h, :k])
    return [batch.table[row].tolist().index(p) for p in phys]


@pytest.mark.parametrize("summary_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("loaded", [False, True], ids=["written", "loaded-over-other-blocks"])
def test_sparse_rows_attend_exactly_their_heads_selections_and_other_rows_are_untouched(loaded, summary_dtype):
    """Also when the blocks held another request's keys and this one's arrived by a connector load:
    their summaries are recomputed from the cache, not the previous request's."""
    # two long decodes (300 and 270 tokens), a prefill chunk of 5 tokens, a short decode (under min_tokens)
    seq_lens, query_lens = [300, 69, 270, 40], [1, 5, 1, 1]
    options = {"sparse_ratio": 0.4, "min_blocks": 1, "summary_dtype": summary_dtype}
    config = {"algorithm": "gsa", "min_tokens": 64, "gsa": options}
    batch, plan, tables, out, dense = run(config, seq_lens, query_lens, loaded=loaded)
    assert plan.rows.tolist() == [0, 2]
    (table,) = tables
    for row in (0, 2):
        n = -(-seq_lens[row] // B)
        token = batch.starts[row]
        for h in range(HKV):
            blocks = chosen_blocks(batch, plan, table, row, h)
            assert blocks == sorted(blocks) and blocks[0] == 0 and blocks[-1] == n - 1
            assert len(blocks) == math.ceil(0.4 * n)  # sink, one chosen block, local window
            assert batch.planted[row, h] in blocks  # the block that matters for this head
            want = batch.reference(row, h, blocks)
            torch.testing.assert_close(out[token, h * G : (h + 1) * G], want, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(out[token], dense[token], atol=1e-3)  # it really skipped blocks
    others = [batch.starts[1] + i for i in range(5)] + [batch.starts[3]]
    torch.testing.assert_close(out[others], dense[others], rtol=0, atol=0)  # vLLM's result


def test_a_prompt_chunk_is_observed_from_the_kernels_cache():
    """observation_window: the attention a prompt chunk's last tokens give each block, read from
    the cache as vLLM's kernel lays it out, equals plain attention over the request's keys."""
    config = {"algorithm": "gsa", "min_tokens": 64, "gsa": {"sparse_ratio": 0.4, "observation_window": 3}}
    seq_lens, query_lens = [300, 69], [1, 5]
    batch, *_ = run(config, seq_lens, query_lens)
    prior = RUNTIMES[SPARSE_LAYER].priors[SPARSE_LAYER]
    s, n, end = seq_lens[1], -(-seq_lens[1] // B), batch.starts[2]
    slots = batch.table[1, torch.arange(s) // B].long() * B + torch.arange(s) % B
    keys = batch.keys[slots].repeat_interleave(G, dim=1)  # (s, H, D)
    logits = torch.einsum("whd,thd->hwt", batch.query[end - 3 : end], keys) / math.sqrt(D)
    logits.masked_fill_(torch.arange(s)[None, :] > torch.arange(s - 3, s)[:, None], float("-inf"))
    per_token = logits.softmax(-1).mean(1).view(HKV, G, s).sum(1)
    want = torch.stack([per_token[:, b * B : (b + 1) * B].sum(-1) for b in range(n)])  # (n, HKV)
    torch.testing.assert_close(prior[batch.table[1, :n].long()], want, rtol=1e-4, atol=1e-6)
    assert float(prior[batch.table[0, : -(-seq_lens[0] // B)].long()].abs().sum()) == 0  # a decode: not observed


def test_dense_layers_attend_every_block():
    config = {"algorithm": "gsa", "min_tokens": 64, "gsa": {"sparse_ratio": 0.3}}
    _, plan, tables, out, dense = run(config, [300, 270], [1, 1], name=DENSE_LAYER)
    assert plan is not None and tables == []
    torch.testing.assert_close(out, dense, rtol=0, atol=0)


@pytest.mark.parametrize(
    "config",
    [
        {"algorithm": "esa", "esa": {"sparse_ratio": 1.0}},
        {"algorithm": "gsa", "gsa": {"sparse_ratio": 1.0}},
        {"algorithm": "kvstar", "kvstar": {"sparse_ratio": 1.0, "retrieval_stride": 2}},
        {"algorithm": "gsa_ondevice", "gsa_ondevice": {"sparse_ratio": 1.0, "hash_bits": 32}},
        {"algorithm": "psa", "psa": {"eps": 1.0}},
        {"algorithm": "static", "static": {"sparse_ratio": 1.0}},
    ],
    ids=lambda c: c["algorithm"],
)
def test_a_full_budget_is_dense_attention(config):
    _, plan, _, out, dense = run({**config, "min_tokens": 1}, [300, 130], [1, 1])
    assert plan.rows.tolist() == [0, 1] and plan.kept.tolist() == [10, 5]
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-5)


def test_a_static_selection_keeps_the_sinks_and_the_most_recent_blocks():
    config = {"algorithm": "static", "min_tokens": 64, "static": {"sparse_ratio": 0.4, "min_blocks": 1}}
    batch, plan, tables, out, _ = run(config, [300], [1])
    (table,) = tables
    for h in range(HKV):
        assert chosen_blocks(batch, plan, table, 0, h) == [0, 7, 8, 9]
        torch.testing.assert_close(
            out[0, h * G : (h + 1) * G], batch.reference(0, h, [0, 7, 8, 9]), rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize(("dtype", "isa"), [(torch.float32, "vec"), (torch.bfloat16, "vec"), (torch.bfloat16, "amx")])
def test_summaries_refreshed_from_the_kernels_cache_layout_equal_those_kept_at_write(dtype, isa):
    """A block loaded by the connector is summarized from the cache as vLLM's writer laid it out."""
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: vLLM never uses that layout here")
    runtime = runtime_for({"algorithm": "gsa", "gsa": {}})
    keys, values = torch.randn(2, 3 * B, HKV, D).to(dtype)
    cache = torch.zeros(3, HKV, 2 * B, D, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, torch.arange(3 * B), isa)
    runtime.write(SPARSE_LAYER, keys, torch.arange(3 * B), 3, dtype)
    summaries = runtime.summaries[SPARSE_LAYER]
    kept = summaries.rep.clone()
    runtime.invalidate(torch.tensor([0, 2]))
    stale = summaries.stale(torch.arange(3, dtype=torch.int32)[None], torch.tensor([3]))
    assert stale.tolist() == [0, 2]
    summaries.rep.zero_()
    summaries.refresh(key_cache, learn_layout(dtype, isa, B, D)[0], stale)
    assert torch.equal(summaries.rep[[0, 2]], kept[[0, 2]])
    assert summaries.count.tolist() == [B, B, B]


def offloading_two_rows(
    seq_lens: list[int], left: list[int], slots: list[int]
) -> Callable[[SparseRuntime, Batch], None]:
    """What the connector does for rows 0 and 2 (decoding) when off-load frees their middle blocks:
    the blocks move to the arena, 6 free cache blocks each become their slots, and the blocks they
    left are overwritten by their next owners. Records the blocks left and the slots."""

    def offload(runtime: SparseRuntime, batch: Batch) -> None:
        caches = {name: batch.kv_cache for name in runtime.layer_names}
        runtime.allocate_arena(caches)
        n = [-(-s // B) for s in seq_lens]
        free = sorted(set(range(POOL)) - {int(batch.table[r, c]) for r in range(len(n)) for c in range(n[r])})
        init, local = runtime.windows
        writing, used = {}, 0
        for row in (0, 2):
            blocks = batch.table[row, init : n[row] - local].tolist()
            mine, free = free[:6], free[6:]
            runtime.offload(f"r{row}", init, blocks, list(range(used, used + len(blocks))), mine, caches)
            used += len(blocks)
            left.extend(blocks)
            slots.extend(mine)
            writing[f"r{row}"] = int(batch.table[row, n[row] - 1])
        batch.kv_cache[left] = torch.randn(len(left), *batch.kv_cache.shape[1:])  # the blocks' next owners
        runtime.place_offloaded(writing)

    return offload


@pytest.mark.parametrize("algorithm", ["esa", "gsa", "gsa:bfloat16", "kvstar", "psa"])
def test_offloaded_blocks_are_attended_from_the_arena_as_they_were_from_the_cache(algorithm):
    """offload_blocks: two decoding requests' middle blocks moved to the host arena, their cache
    blocks then overwritten by other requests: the step attends the same blocks with the same bytes
    (the output equals that without off-load, bit for bit), the kept arena blocks through the
    requests' slots, never through the blocks they left. (gsa, int8 by default: the scales move with
    the bytes.)"""
    algorithm, _, summary_dtype = algorithm.partition(":")
    options = {"psa": {"max_ratio": 0.6}}.get(algorithm, {"sparse_ratio": 0.4, "min_blocks": 1})
    if summary_dtype:
        options["summary_dtype"] = summary_dtype
    config = {"algorithm": algorithm, "min_tokens": 64, "dense_layers": 0, algorithm: options}
    seq_lens, query_lens = [300, 69, 270], [1, 5, 1]
    *_, want, _ = run(config, seq_lens, query_lens)
    RUNTIMES.clear()
    left: list[int] = []
    slots: list[int] = []
    offload = offloading_two_rows(seq_lens, left, slots)
    _, plan, tables, out, _ = run({**config, "offload_blocks": 20}, seq_lens, query_lens, before_forward=offload)
    assert plan.rows.tolist() == [0, 2]
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    (table,) = tables
    named = set((table // HKV).flatten().tolist())
    assert not named & set(left) and named & set(slots)


def test_a_dense_layer_attends_offloaded_rows_over_every_block_from_the_arena():
    """With dense layers (the default 2), off-loaded rows' dense layers read their middle blocks
    from the arena and the rest from the cache, in one call: the output equals dense attention
    without off-load bit for bit, the prefill chunk's row included, though the blocks they left
    hold other requests' bytes now."""
    config = {"algorithm": "esa", "min_tokens": 64, "esa": {"sparse_ratio": 0.4, "min_blocks": 1}}
    seq_lens, query_lens = [300, 69, 270], [1, 5, 1]
    *_, want, _ = run(config, seq_lens, query_lens, name=DENSE_LAYER)
    RUNTIMES.clear()
    left: list[int] = []
    offload = offloading_two_rows(seq_lens, left, [])
    _, plan, tables, out, vllm = run(
        {**config, "offload_blocks": 20}, seq_lens, query_lens, name=DENSE_LAYER, before_forward=offload
    )
    assert plan.offloaded is not None and plan.offloaded.rows.tolist() == [0, 2] and tables == []
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    decodes = [0, 1 + 5]  # rows 0 and 2's query tokens
    assert not torch.allclose(vllm[decodes], want[decodes], atol=1e-3)  # the cache alone holds others' bytes


def test_offload_is_refused_for_models_with_alibi():
    """Their layers attend through vLLM's call over the whole cache, blocks freed by off-load included."""
    config = VllmConfig()
    object.__setattr__(config, "model_config", types.SimpleNamespace(dtype=torch.float32))
    sparse = {"algorithm": "esa", "offload_blocks": 16}
    transfer = kv_transfer_config({"spec": "posix", "posix": {"roots": ["/unused"]}}, sparse=sparse)
    config.kv_transfer_config = KVTransferConfig(**transfer)
    with set_current_vllm_config(config), pytest.raises(ConfigError, match="ALiBi or attention sinks cannot off-load"):
        UCMAttentionImpl(H, D, 1 / math.sqrt(D), HKV, [0.5] * H, None, "auto")


def test_gsa_ondevice_refuses_more_hash_bits_than_head_dim():
    config = SparseConfig.model_validate({"algorithm": "gsa_ondevice", "gsa_ondevice": {"hash_bits": 128}})
    with pytest.raises(ConfigError, match=r"sparse.gsa_ondevice.hash_bits: .*head_dim=64"):
        SparseRuntime(config, B, HKV, D, [SPARSE_LAYER])
