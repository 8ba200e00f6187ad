"""The serving runtime's step plan, without vLLM: which rows decode sparsely, their budgets and the
lengths the kernel sees, selections reused between retrievals (plus the blocks started since),
requests recognized across steps, and the counts it publishes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from pydantic import ValidationError

from ucm.sparse.config import SparseConfig
from ucm.sparse.serving import SparseRuntime
from ucm.sparse.summaries import QUANTIZED

HKV, G, D, B = 2, 2, 64, 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def runtime(config: dict) -> SparseRuntime:
    positions = torch.arange(B * D, dtype=torch.int32)  # keys stored plainly
    return SparseRuntime(SparseConfig.model_validate(config), B, HKV, D, LAYERS, key_positions=positions)


def step(
    rt: SparseRuntime,
    tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    keys=None,
    before_forward: Callable[[], None] | None = None,
):
    """One engine step: the decode tokens written, the plan made, every sparse layer selecting.
    ``before_forward``: what the connector does between the plan and the forward."""
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    g = torch.Generator().manual_seed(sum(seq_lens))
    for i, (s, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        positions = torch.arange(s - q_len, s)
        slots = tables[i, positions // B].long() * B + positions % B
        for name in LAYERS[rt.dense_layers :]:
            rt.write(name, torch.randn(q_len, HKV, D, generator=g), slots, 64, torch.float32)
    plan = rt.begin_step(tables, seq, starts)
    if before_forward is not None:
        before_forward()
    chosen = {}
    if plan is not None:
        query = torch.randn(int(starts[-1]), HKV * G, D, generator=g)
        for name in LAYERS[rt.dense_layers :]:
            chosen[name] = rt.select(
                name, query, torch.zeros(64, HKV, B, 2 * D), torch.arange(B * D, dtype=torch.int32), D**-0.5
            )
    return plan, chosen


def tables_for(*lengths: int) -> torch.Tensor:
    width = max(-(-n // B) for n in lengths) + 2
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    base = 0
    for i in range(len(lengths)):
        table[i] = torch.arange(base, base + width, dtype=torch.int32)
        base += width
    return table


def test_only_long_decodes_are_sparse_with_their_budgets_and_kernel_lengths():
    rt = runtime({"algorithm": "gsa", "min_tokens": 100, "dense_layers": 2, "gsa": {"sparse_ratio": 0.5}})
    tables = tables_for(300, 90, 150, 400)
    # prefill rows (query > 1) write their chunk; the decode rows the token of this step
    plan, chosen = step(rt, tables, [300, 90, 150, 400], [300, 90, 150, 400])
    assert plan is None and chosen == {}  # all prefill
    plan, chosen = step(rt, tables, [301, 91, 151, 401], [1, 1, 1, 1])
    assert plan.rows.tolist() == [0, 2, 3]  # 91 < min_tokens
    n = torch.tensor([10, 5, 13])  # blocks of 301, 151 and 401 tokens
    assert plan.kept.tolist() == torch.ceil(n * 0.5).long().clamp(min=4).tolist()
    tails = torch.tensor([301 - 9 * B, 151 - 4 * B, 401 - 12 * B])
    assert plan.lens.tolist() == ((plan.kept - 1) * B + tails).repeat_interleave(HKV).tolist()
    assert set(chosen) == set(LAYERS[2:])  # dense layers select nothing
    assert rt.stats.requests == 3
    assert (rt.stats.decodes, rt.stats.short) == (3, 1)  # the short decode is counted as such


@pytest.mark.parametrize("algorithm", ["esa", "gsa", "kvstar"])
def test_between_retrievals_a_selection_is_reused_plus_the_block_started_since(algorithm):
    options = {"sparse_ratio": 0.3, "retrieval_stride": 3}
    rt = runtime({"algorithm": algorithm, "min_tokens": 64, "dense_layers": 0, algorithm: options})
    tables = tables_for(330)
    step(rt, tables, [318], [318])
    seen = []
    for seq in range(319, 326):  # crosses into block 10 at 321
        plan, chosen = step(rt, tables, [seq], [1])
        seen.append((seq, plan, chosen))
    for (seq, plan, chosen), (_, _, before) in zip(seen[1:], seen[:-1], strict=True):
        due = (seq - 319) % 3 == 0
        assert (plan.due is None) == due
        if due:
            continue
        for name, (table, lens) in chosen.items():
            old, _ = before[name]
            assert lens.tolist() == plan.lens.tolist()
            if seq == 321:  # a new block: the reused selection plus it
                n = -(-seq // B)
                prev_k = int(plan.kept[0]) - 1
                assert torch.equal(table[:, :prev_k], old[:, :prev_k])
                assert table[:, prev_k].tolist() == [(n - 1) * HKV + h for h in range(HKV)]
            else:
                k = int(plan.kept[0])
                assert torch.equal(table[:, :k], old[:, :k])
    assert rt.stats.requests + rt.totals.requests == 1  # one request throughout


def test_a_new_request_in_a_reused_block_is_not_mistaken_for_the_old_one():
    rt = runtime({"algorithm": "esa", "min_tokens": 64, "dense_layers": 0, "esa": {"retrieval_stride": 4}})
    tables = tables_for(200)
    step(rt, tables, [150], [150])
    step(rt, tables, [151], [1])
    plan, _ = step(rt, tables, [180], [1])  # same blocks, but not one token longer: another request
    assert plan is None  # its prompt's last token (the rest cached): dense
    plan, _ = step(rt, tables, [181], [1])
    assert plan.due is None  # its first selection
    plan, _ = step(rt, tables, [182], [1])
    assert plan.due is not None and len(plan.due) == 0  # now it continues
    assert rt.stats.requests + rt.totals.requests == 2


def test_static_selection_takes_no_retrieval_stride():
    with pytest.raises(ValidationError, match=r"static\.retrieval_stride"):
        SparseConfig.model_validate({"algorithm": "static", "static": {"retrieval_stride": 2}})


def test_int8_summaries_are_refused_beside_the_mean_key():
    with pytest.raises(ValidationError, match=r"summary_dtype: int8 scores block_repre 'bound' only"):
        SparseConfig.model_validate({"algorithm": "gsa", "gsa": {"summary_dtype": "int8", "block_repre": "both"}})


@pytest.mark.parametrize(
    ("options", "dtype"),
    [({}, QUANTIZED), ({"block_repre": "both"}, None), ({"summary_dtype": "bfloat16"}, None)],
)
def test_gsa_scores_the_bound_from_int8_unless_told_otherwise_or_beside_the_mean_key(options, dtype):
    """The default needs no summary_dtype with either block_repre: int8 for the bound, bfloat16 with both."""
    config = SparseConfig.model_validate({"algorithm": "gsa", "gsa": options})
    assert config.options.scoring(64).dtype == dtype


def test_counts_cover_dense_layers_and_sparse_layers():
    rt = runtime({"algorithm": "static", "min_tokens": 64, "dense_layers": 1, "static": {"sparse_ratio": 0.5}})
    tables = tables_for(320)
    step(rt, tables, [320], [320])
    plan, _ = step(rt, tables, [321], [1])
    n, k = 11, int(plan.kept[0])
    assert (rt.stats.available, rt.stats.attended) == (4 * n, n + 3 * k)
    assert rt.stats.retrievals == 3


def test_what_a_prompt_attended_at_its_end_stays_selected_while_it_decodes():
    """observation_window: the last prompt tokens' exact attention, per block and KV head, is kept
    as a prior and added to the block scores of every decode step."""
    config = SparseConfig.model_validate(
        {"algorithm": "gsa", "min_tokens": 64, "dense_layers": 0, "gsa": {"sparse_ratio": 0.2, "observation_window": 4}}
    )
    rt = SparseRuntime(config, B, HKV, D, LAYERS, key_positions=torch.arange(B * D, dtype=torch.int32))
    length = 20 * B
    table = tables_for(length + 1)
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(length, HKV, D, generator=g)
    needle = 5
    direction = torch.nn.functional.normalize(torch.randn(HKV, D, generator=g), dim=-1)
    keys[needle * B : (needle + 1) * B] = 6 * direction  # what the prompt's last tokens look for
    query = torch.randn(length, HKV * G, D, generator=g)
    query[-4:] = 6 * direction.repeat_interleave(G, dim=0)
    slots = table[0, torch.arange(length) // B].long() * B + torch.arange(length) % B
    key_cache = torch.zeros(64, HKV, B, D)
    key_cache[slots // B, :, slots % B] = keys
    starts, seq = torch.tensor([0, length], dtype=torch.int32), torch.tensor([length], dtype=torch.int32)
    assert rt.begin_step(table, seq, starts) is None  # the prompt's step: observed, no sparse row
    for name in LAYERS:
        rt.write(name, keys, slots, 64, torch.float32)
        rt.observe(name, query, key_cache, starts, seq, table, D**-0.5)

    # The reference: softmax of each window query over the prompt (causal), averaged over the
    # window, summed over the query heads of each KV head, summed per block.
    logits = torch.einsum("whd,thd->hwt", query[-4:], keys.repeat_interleave(G, dim=1)) * D**-0.5
    logits.masked_fill_(torch.arange(length)[None, :] > torch.arange(length - 4, length)[:, None], float("-inf"))
    share = logits.softmax(-1).mean(1).view(HKV, G, -1).sum(1).view(HKV, 20, B).sum(-1)
    for name in LAYERS:
        torch.testing.assert_close(rt.priors[name][table[0, :20].long()], share.T)
    assert bool((share[:, needle] > 0.5 * G).all())  # most of the window looks at the needle

    _, chosen = step(rt, table, [length + 1], [1])  # a decode: new token, random query
    assert float(rt.priors[LAYERS[0]][table[0, 20]].abs().sum()) == 0  # the block it started holds no prior
    for name in LAYERS:
        per_head, _ = chosen[name]
        for h in range(HKV):
            assert int(table[0, needle]) * HKV + h in per_head[h].tolist()


def test_the_last_prompt_token_after_a_cached_prompt_attends_densely_and_is_observed():
    """A PD decode engine (or a warm prompt) gets the prompt from the store but its last token:
    that token is computed alone, like a decode, and attends densely as it would at the end of a
    computed prompt; the request's next step is its first sparse one."""
    rt = runtime({"algorithm": "gsa", "min_tokens": 100, "dense_layers": 0, "gsa": {"sparse_ratio": 0.5}})
    tables = tables_for(300, 400)
    plan, chosen = step(rt, tables, [300, 401], [1, 1])  # two prompts whose last token alone is computed
    assert plan is None and chosen == {}
    assert rt.observed.tolist() == [0, 1]
    assert (rt.stats.first, rt.stats.requests) == (2, 0)
    plan, _ = step(rt, tables, [301, 402], [1, 1])
    assert plan.rows.tolist() == [0, 1] and plan.due is None
    assert rt.stats.requests == 2  # their first sparse step
    assert len(rt.observed) == 0


def test_offload_is_refused_with_the_static_selection():
    with pytest.raises(ValidationError, match="offload_blocks: static keeps the most recent blocks"):
        SparseConfig.model_validate({"algorithm": "static", "offload_blocks": 64})


def decoding_with_offload(algorithm: str, options: dict) -> tuple[SparseRuntime, dict, torch.Tensor]:
    """A runtime that off-loads, its caches, and a request of blocks 0-12 that computed its prompt
    (318 tokens) and decoded its first token: the next step may off-load it."""
    config = {"algorithm": algorithm, "min_tokens": 64, "dense_layers": 0, "offload_blocks": 16, algorithm: options}
    rt = runtime(config)
    caches = {name: torch.zeros(64, HKV, B, 2 * D) for name in LAYERS}
    rt.allocate_arena(caches)
    tables = tables_for(330)
    step(rt, tables, [318], [318])
    step(rt, tables, [319], [1])
    return rt, caches, tables


def test_an_offloaded_request_back_after_a_step_without_it_decodes_sparsely_and_retrieves_afresh():
    """vLLM may leave a running request out of a step (its token budget spent on others): an
    off-loaded one must not come back as a new request (attending densely, its table naming blocks
    other requests hold now), and its last selection is stale: it retrieves."""
    rt, caches, tables = decoding_with_offload("kvstar", {"sparse_ratio": 0.3, "retrieval_stride": 4})
    moved = list(range(1, 8))

    def offload() -> None:
        rt.offload("r", 1, moved, list(range(7)), list(range(40, 46)), caches)
        rt.place_offloaded({"r": 9})  # 320 tokens: it writes into block 9

    step(rt, tables, [320], [1], before_forward=offload)
    other = torch.arange(20, 33, dtype=torch.int32)[None]
    step(rt, other, [100], [100])  # a step without it
    plan, chosen = step(rt, tables, [321], [1], before_forward=lambda: rt.place_offloaded({"r": 10}))
    assert plan is not None and plan.rows.tolist() == [0] and plan.due is None  # sparse, retrieving
    for table, _ in chosen.values():
        named = set((table // HKV).flatten().tolist())
        assert not named & set(moved)


def test_a_request_whose_budget_is_its_windows_is_offloaded_with_no_slots():
    """A short budget keeps only the sink and local windows: the request gives back all its middle
    blocks and takes no slots (the planner's K is 0); it decodes over its windows."""
    rt, caches, tables = decoding_with_offload("esa", {"sparse_ratio": 0.05, "min_blocks": 1, "local_window_sz": 1})
    moved = list(range(1, 9))

    def offload() -> None:
        rt.offload("r", 1, moved, list(range(8)), [], caches)
        rt.place_offloaded({"r": 9})

    plan, chosen = step(rt, tables, [320], [1], before_forward=offload)
    assert plan is not None and plan.kept.tolist() == [2]  # the sink and the block it writes
    for table, _ in chosen.values():
        assert not set((table // HKV).flatten().tolist()) & set(moved)
