"""The native sparse kernels (ucm_native) against plain-torch references: summaries kept at write
time equal a recomputation (after appends, chunked writes, block reuse and invalidation), block
scores equal the reference's, and selection keeps the windows plus a true top-k of those scores,
per KV head, as rows of the per-head cache view."""

from __future__ import annotations

import math

import pytest
import torch

from tests.sparse import reference
from ucm.sparse.summaries import QUANTIZED, BlockSummaries, Scoring, fetch_into_slots

HKV, G, D, B = 3, 3, 64, 32
H = HKV * G
SCALE = 1 / math.sqrt(D)
SCORINGS = {
    "both": Scoring("both"),
    "bound": Scoring("bound"),
    "bound-int8": Scoring("bound", dtype=QUANTIZED),
    "mean": Scoring("mean"),
    "mean-pruned-f16": Scoring("mean", dtype=torch.float16, keep_channels=0.5),
    "hash": Scoring("hash", hash_bits=32, seed=3),
}


def written(scoring: Scoring, tokens: int, blocks: int = 40, dtype=torch.bfloat16, seed: int = 0):
    """Summaries of ``tokens`` keys written into a shuffled block table, in uneven chunks."""
    g = torch.Generator().manual_seed(seed)
    s = BlockSummaries(scoring, blocks, B, HKV, D, dtype)
    keys = torch.randn(tokens, HKV, D, generator=g).to(dtype)
    n = -(-tokens // B)
    table = torch.randperm(blocks, generator=g)[:n].to(torch.int32)
    slots = table.long()[torch.arange(tokens) // B] * B + torch.arange(tokens) % B
    start = 0
    for size in (37, 1, 200, 5, 1, 1, tokens):  # prefill chunks, then decode-sized appends
        end = min(tokens, start + size)
        s.write(keys[start:end], slots[start:end])
        start = end
    return s, keys, table


def block_summary(s: BlockSummaries, p: int):
    if s.dtype == QUANTIZED:
        return s.lo[p], s.hi[p], s.rep[p], s.rep_scale[p]
    if s.scoring.mode == "bound":
        return s.lo[p], s.hi[p], s.rep[p]
    if s.scoring.mode == "both":
        return s.lo[p], s.hi[p], s.mean[p], s.rep[p]
    if s.scoring.mode == "mean":
        return s.mean[p], s.rep[p]
    return (s.hashes[p],)


@pytest.mark.parametrize("name", SCORINGS)
def test_summaries_kept_at_write_equal_a_recomputation(name):
    scoring = SCORINGS[name]
    tokens = 7 * B + 11
    s, keys, table = written(scoring, tokens)
    for i, p in enumerate(table.tolist()):
        want = reference.summary(scoring, keys[i * B : (i + 1) * B], torch.bfloat16, s.dtype)
        got = block_summary(s, p)
        fill = min(B, tokens - i * B)
        assert int(s.count[p]) == fill
        if s.dtype == QUANTIZED:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert torch.equal(got[3], want[3])  # the scales
            assert torch.equal(got[2][:, 0], want[2][:, 0])  # centres rounded to nearest
            # radii: rounded up from r plus the centre's error, which a fused multiply-add may
            # compute a last bit apart
            assert int((got[2][:, 1].int() - want[2][:, 1].int()).abs().max()) <= 1
        elif scoring.mode in ("bound", "both"):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # extremes are exact
            torch.testing.assert_close(got[-1][:, -2:].float(), want[-1][:, -2:].float(), rtol=0, atol=0)
            if scoring.mode == "both":
                torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
        elif scoring.mode == "mean":
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got[0][:fill], want[0])


def test_a_block_written_again_from_offset_zero_starts_afresh():
    scoring = SCORINGS["bound"]
    s = BlockSummaries(scoring, 4, B, HKV, D, torch.float32)
    old = torch.full((B, HKV, D), 100.0)
    s.write(old, torch.arange(B) + 2 * B)  # block 2, full of large keys
    new = torch.randn(5, HKV, D)
    s.write(new, torch.arange(5) + 2 * B)  # the block handed to another request
    assert int(s.count[2]) == 5
    torch.testing.assert_close(s.hi[2], new.amax(0))
    torch.testing.assert_close(s.lo[2], new.amin(0))


def test_padding_slots_are_skipped():
    s = BlockSummaries(SCORINGS["mean"], 4, B, HKV, D, torch.float32)
    keys = torch.randn(3, HKV, D)
    s.write(keys, torch.tensor([B, -1, B + 1]))
    torch.testing.assert_close(s.mean[1], (keys[0] + keys[2]) / 2)
    assert int(s.count[1]) == 2


@pytest.mark.parametrize("name", ["bound", "bound-int8", "mean", "both"])
def test_invalidated_blocks_are_reported_stale_until_refreshed(name):
    """Refreshed from the cache, a block's summary is bit for bit the one its writes kept (refresh
    folds a block's keys at once, write one token at a time)."""
    s, keys, table = written(SCORINGS[name], 4 * B + 3)
    tables = table[None]
    full = torch.tensor([4])
    assert len(s.stale(tables, full)) == 0
    s.invalidate(table[[1, 2]])
    assert sorted(s.stale(tables, full).tolist()) == sorted(table[[1, 2]].tolist())
    # Refresh from a cache holding the same keys in plain (token, channel) order.
    cache = torch.zeros(40, HKV, B, D, dtype=torch.bfloat16)
    t = torch.arange(4 * B)
    cache[table.long()[t // B], :, t % B] = keys[: 4 * B]
    before = [t.clone() for t in (s.rep, s.rep_scale, s.mean, s.lo, s.hi)]
    for t in (s.rep, s.rep_scale, s.mean, s.lo, s.hi):
        if t.numel():
            t[table[[1, 2]].long()] = 0
    s.refresh(cache, torch.arange(B * D, dtype=torch.int32), s.stale(tables, full))
    assert len(s.stale(tables, full)) == 0
    for t, kept in zip((s.rep, s.rep_scale, s.mean, s.lo, s.hi), before, strict=True):
        assert torch.equal(t, kept)


def select(s, q, tables, seq_lens, budget, windows=(1, 2), mass=0.0, prior=None, device="cpu"):
    """``s.select`` with its arguments and outputs on ``device``; the outputs come back on the CPU."""
    r = len(seq_lens)
    width = int(tables.shape[1])
    out = torch.full((r * HKV, width), -1, dtype=torch.int32, device=device)
    kept = torch.zeros(r * HKV, dtype=torch.int32, device=device)
    scores = torch.zeros(r * HKV, width, device=device)
    s.select(
        q.to(device),
        torch.arange(r, dtype=torch.int32, device=device),
        tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(budget, dtype=torch.int32, device=device),
        windows,
        SCALE,
        out,
        mass=mass,
        kept=kept,
        scores=scores,
        prior=None if prior is None else prior.to(device),
    )
    return out.cpu(), kept.cpu(), scores.cpu()


def test_a_prior_is_added_to_each_block_score_by_physical_block_and_head():
    tokens = 23 * B + 9
    s, _, table = written(SCORINGS["both"], tokens, blocks=60, seed=7)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(8))
    n = table.numel()
    _, _, plain = select(s, q, table[None].contiguous(), [tokens], [6])
    prior = torch.zeros(60, HKV)
    favoured = {0: int(table[4]), 1: int(table[9]), 2: int(table[13])}  # a physical block per head
    for h, p in favoured.items():
        prior[p, h] = 5.0  # more than any block's share of the group's attention (at most G)
    out, _, scores = select(s, q, table[None].contiguous(), [tokens], [6], prior=prior)
    for h in range(HKV):
        torch.testing.assert_close(scores[h, :n], plain[h, :n] + prior[table.long(), h])
        assert favoured[h] in (out[h, :6] // HKV).tolist()


@pytest.mark.parametrize("name", SCORINGS)
def test_selection_keeps_the_windows_and_a_top_k_of_the_reference_scores_per_head(name):
    scoring = SCORINGS[name]
    tokens = 23 * B + 9
    s, _, table = written(scoring, tokens, blocks=60, seed=1)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(2))
    n = table.numel()
    k = 9
    out, kept, scores = select(s, q, table[None].contiguous(), [tokens], [k])
    fills = [min(B, tokens - i * B) for i in range(n)]
    summaries = [block_summary(s, p) for p in table.tolist()]
    for h in range(HKV):
        want = reference.group_scores(scoring, q[0], summaries, fills, h, HKV, SCALE, s.dtype)
        torch.testing.assert_close(scores[h, :n], want, rtol=2e-3, atol=1e-6)
        rows = out[h, :k]
        assert int(kept[h]) == k
        assert torch.all(rows % HKV == h), "rows address this head of each block"
        logical = [table.tolist().index(p) for p in (rows // HKV).tolist()]
        assert logical == sorted(logical) and logical[-1] == n - 1
        assert {0, n - 2, n - 1} <= set(logical)  # sink and local windows
        chosen = set(logical) - {0, n - 2, n - 1}
        rest = set(range(1, n - 2)) - chosen
        assert min(want[list(chosen)]) >= max(want[list(rest)]) * (1 - 1e-3)


def test_the_top_k_is_exact_at_any_length_with_ties_and_scores_below_zero():
    """The cut is the exact k-th largest score: blocks above it are kept, then tied blocks from the
    lowest; scores below zero (a negative prior) order as numbers do."""
    n = 70  # four vectors of 16 blocks and a tail
    tokens = n * B
    s = BlockSummaries(SCORINGS["both"], n, B, HKV, D, torch.float32)
    s.write(torch.ones(tokens, HKV, D), torch.arange(tokens))  # every block's estimate is the same
    prior = (-10 - 0.25 * (torch.arange(n) % 7)).float()[:, None].expand(n, HKV).contiguous()
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(11))
    table = torch.arange(n, dtype=torch.int32)[None]
    for k in (2, 3, 10, 20, 37, 69):  # 2: fewer than the windows, which tie
        out, _, scores = select(s, q, table, [tokens], [k], windows=(1, 2), prior=prior)
        for h in range(HKV):
            rank = scores[h, :n].tolist()
            rank[0] = rank[n - 2] = rank[n - 1] = math.inf
            want = sorted(sorted(range(n), key=lambda blk: (-rank[blk], blk))[:k])
            assert (out[h, :k] // HKV).tolist() == want, f"k={k}, head {h}"


@pytest.mark.parametrize("name", ["both", "bound", "bound-int8", "mean"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_scores_at_the_head_dims_scored_several_blocks_at_a_time(name, head_dim):
    """Head dims 64 and 128 take an unrolled path: 16 blocks at a time where the CPU has AVX-512
    BF16 (AVX-512 VNNI for int8), 8 where it has AVX2 (40 blocks: two groups of 16 and a tail, or
    five of 8), each against the reference."""
    scoring, n = SCORINGS[name], 40
    g = torch.Generator().manual_seed(12)
    s = BlockSummaries(scoring, n, B, HKV, head_dim, torch.bfloat16)
    s.write(torch.randn(n * B, HKV, head_dim, generator=g).to(torch.bfloat16), torch.arange(n * B))
    table = torch.randperm(n, generator=g).to(torch.int32)
    q = torch.randn(1, H, head_dim, generator=g)
    scale = 1 / math.sqrt(head_dim)
    out = torch.zeros(HKV, n, dtype=torch.int32)
    scores = torch.zeros(HKV, n)
    one = torch.zeros(1, dtype=torch.int32)
    s.select(
        q,
        one,
        table[None],
        torch.tensor([n * B], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        (1, 2),
        scale,
        out,
        scores=scores,
    )
    summaries = [block_summary(s, p) for p in table.tolist()]
    for h in range(HKV):
        want = reference.group_scores(scoring, q[0], summaries, [B] * n, h, HKV, scale, s.dtype)
        torch.testing.assert_close(scores[h], want, rtol=2e-3, atol=1e-6)


def test_heads_of_one_request_select_different_blocks():
    """Each KV head's query group sees its own keys: a block planted for head h wins for h only."""
    tokens = 20 * B
    s = BlockSummaries(SCORINGS["both"], 20, B, HKV, D, torch.float32)
    g = torch.Generator().manual_seed(4)
    keys = 0.1 * torch.randn(tokens, HKV, D, generator=g)
    q = torch.zeros(1, H, D)
    planted = {0: 5, 1: 11, 2: 16}
    for h, blk in planted.items():
        direction = torch.randn(D, generator=g)
        keys[blk * B + 7, h] = 4 * direction
        q[0, h * G : (h + 1) * G] = direction
    s.write(keys, torch.arange(tokens))
    out, _, _ = select(s, q, torch.arange(20, dtype=torch.int32)[None], [tokens], [4])
    for h, blk in planted.items():
        blocks = (out[h, :4] // HKV).tolist()
        assert blk in blocks
        assert all(planted[o] not in blocks for o in planted if o != h)


def test_a_budget_of_every_block_keeps_every_block():
    tokens = 9 * B + 1
    s, _, table = written(SCORINGS["mean"], tokens, seed=5)
    out, _, _ = select(s, torch.randn(1, H, D), table[None].contiguous(), [tokens], [10])
    for h in range(HKV):
        assert (out[h, :10] // HKV).tolist() == table.tolist()


def test_adaptive_budget_keeps_the_fewest_blocks_reaching_the_mass():
    tokens = 30 * B
    s, _, table = written(SCORINGS["bound"], tokens, blocks=30, dtype=torch.float32, seed=6)
    q = 3 * torch.randn(1, H, D, generator=torch.Generator().manual_seed(7))
    for mass in (0.5, 0.9):
        out, kept, scores = select(s, q, table[None].contiguous(), [tokens], [30], mass=mass)
        for h in range(HKV):
            k = int(kept[h])
            chosen = {table.tolist().index(p) for p in (out[h, :k] // HKV).tolist()}
            forced = {0, 28, 29}
            assert forced <= chosen
            share = scores[h, :30]
            others = sorted(set(range(30)) - forced, key=lambda b: -float(share[b]))
            extra = len(chosen) - len(forced)
            assert chosen - forced == set(others[:extra])  # best first
            reached = float(share[list(chosen)].sum())
            assert reached >= mass * G - 1e-4
            if extra:  # one block fewer would not have reached it
                assert reached - float(share[others[extra - 1]]) < mass * G


@pytest.mark.parametrize("dtype", [torch.float32, QUANTIZED])
def test_the_bound_is_above_every_logit_of_its_block(dtype):
    """Quest's bound, kept as q . c + |q| . r, is never below a key's q . k: in float32, and from
    bytes (the centre's rounding error is in the radius)."""
    tokens = 12 * B
    s, keys, table = written(Scoring("bound", dtype=dtype), tokens, dtype=torch.float32, seed=8)
    q = torch.randn(H, D)
    for i, p in enumerate(table.tolist()):
        c, r = s.rep[p, :, 0].float(), s.rep[p, :, 1].float()  # (Hkv, D)
        if dtype == QUANTIZED:
            c, r = (c - 128) * s.rep_scale[p, :, None], r * s.rep_scale[p, :, None]
        block = keys[i * B : (i + 1) * B]  # (B, Hkv, D)
        if dtype == QUANTIZED:  # per channel, the bytes' interval holds every key: a bound for any query
            scale = s.rep_scale[p, :, None].double()
            centre, radius = (s.rep[p, :, 0].double() - 128) * scale, s.rep[p, :, 1].double() * scale
            exact = block.double()
            assert torch.all(centre - radius <= exact.amin(0)) and torch.all(centre + radius >= exact.amax(0))
        for head in range(H):
            h = head // G
            bound = q[head] @ c[h] + q[head].abs() @ r[h]
            assert float((block[:, h] @ q[head]).max()) <= float(bound) + 1e-4


def test_offload_fetch_copies_kept_arena_blocks_into_slots_once():
    """Off-load's per-layer fetch: each kept arena block lands in one of its request's slot planes
    (its head's), which the table then names; a block a slot holds from an earlier step is not
    copied again; a miss takes a slot no kept block holds; a selection beyond the slots is refused."""
    hkv, resident, arena_blocks = 2, 10, 8
    planes = torch.zeros(resident * hkv, 4, 3)
    arena = torch.arange(arena_blocks * hkv * 12, dtype=torch.float32).view(arena_blocks * hkv, 4, 3)
    holds = torch.full((resident * hkv,), -1, dtype=torch.int32)
    slot_of = torch.full((arena_blocks * hkv,), -1, dtype=torch.int32)
    slots = torch.tensor([[7, 8, 9]])  # one request, three slot blocks

    def step(kept: list[int]) -> int:
        table = torch.tensor(
            [[h] + [(resident + v) * hkv + h for v in kept] for h in range(hkv)], dtype=torch.int32
        )  # block 0 stays in the cache
        copied = fetch_into_slots(table, slots, holds, slot_of, arena, planes)
        for h in range(hkv):
            assert int(table[h, 0]) == h
            for col, v in enumerate(kept, start=1):
                plane = int(table[h, col])
                assert plane // hkv in (7, 8, 9) and plane % hkv == h
                assert torch.equal(planes[plane], arena[v * hkv + h])
        return copied

    assert step([1, 4]) == 4  # two blocks, two heads
    assert step([4, 1]) == 0  # held from the last step
    assert step([4, 6, 2]) == 4  # 6 and 2 are new; 1's slot is free again
    with pytest.raises(RuntimeError, match="more off-loaded blocks than its slots"):
        step([0, 1, 2, 3])
