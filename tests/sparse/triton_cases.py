"""The Triton selection (the GPU path): summaries recomputed from a flash-attention-shaped cache
equal the native kernel's kept at write, block scores equal the plain-torch reference, and the
blocks kept per KV head are the native kernel's choice (fixed and adaptive budgets, windows,
several requests with shuffled block tables). This checks the kernels' arithmetic and indexing,
not their speed.

Run by tests/sparse/test_triton.py in a process of its own: on the CPU with
``TRITON_INTERPRET=1`` (Triton reads the variable when it first decorates its own library, which
in the test session vLLM's import has already done without it), and compiled on a GPU where one
is."""

from __future__ import annotations

import os

import pytest
import torch

from tests.sparse import reference
from tests.sparse.test_kernel import HKV, SCALE, B, D, H, select, written
from ucm.sparse.summaries import QUANTIZED, Scoring

if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    raise RuntimeError("run with TRITON_INTERPRET=1 or on a GPU (tests/sparse/test_triton.py does)")

# After the check: importing decorates the kernels, interpreted or not.
from ucm.sparse.triton_attention import sparse_decode
from ucm.sparse.triton_select import TritonSelector

SCORINGS = {
    "both": Scoring("both"),
    "bound": Scoring("bound"),
    "bound-int8": Scoring("bound", dtype=QUANTIZED),
    "mean": Scoring("mean"),
}


def flash_cache(keys: torch.Tensor, table: torch.Tensor, blocks: int) -> torch.Tensor:
    """``keys`` (N, Hkv, D) placed in a (P, B, Hkv, D) cache along ``table``."""
    cache = torch.zeros(blocks, B, HKV, D, dtype=keys.dtype)
    t = torch.arange(len(keys))
    cache[table.long()[t // B], t % B] = keys
    return cache


def selector_for(scoring: Scoring, tokens: int, blocks: int, seed: int):
    native, keys, table = written(scoring, tokens, blocks=blocks, seed=seed)
    sel = TritonSelector(scoring, blocks, B, HKV, D, DEVICE)
    n = table.numel()
    fills = torch.tensor([min(B, tokens - i * B) for i in range(n)], dtype=torch.int32)
    sel.summarize(flash_cache(keys, table, blocks).to(DEVICE), table.to(DEVICE), fills.to(DEVICE))
    return sel, native, table


def run(s, q, tables, seq_lens, budget, mass=0.0, prior=None):
    """The selection of ``s``, native (on the CPU) or Triton (on DEVICE)."""
    device = DEVICE if isinstance(s, TritonSelector) else "cpu"
    return select(s, q, tables, seq_lens, budget, mass=mass, prior=prior, device=device)


@pytest.mark.parametrize("name", SCORINGS)
def test_summaries_from_the_cache_equal_the_native_ones_kept_at_write(name):
    tokens = 7 * B + 11
    sel, native, table = selector_for(SCORINGS[name], tokens, 40, seed=0)
    idx = table.long()
    rep, count = sel.rep.cpu(), sel.count.cpu()
    assert torch.equal(count[idx], native.count[idx])
    if name == "bound-int8":  # the same quantization; a radius may differ by one step where one side fuses
        assert torch.equal(sel.rep_scale.cpu()[idx], native.rep_scale[idx])  # c - s * c_q into an FMA
        assert torch.equal(rep[idx][:, :, 0], native.rep[idx][:, :, 0])
        assert (rep[idx][:, :, 1].int() - native.rep[idx][:, :, 1].int()).abs().max() <= 1
    elif name != "mean":  # [c | r] from exact extremes; the interpreter rounds to bfloat16 by truncation: 1 ulp
        torch.testing.assert_close(rep[idx][:, :, -2:], native.rep[idx][:, :, -2:], rtol=2**-7, atol=1e-6)
    if name != "bound":  # the mean: a float32 sum in another order, then rounded to bfloat16
        mean, want = rep[idx][:, :, 0].float(), native.rep[idx][:, :, 0].float()
        torch.testing.assert_close(mean, want, rtol=1e-2, atol=1e-3)


def test_the_int8_bound_from_the_cache_contains_every_key_of_its_block():
    """Per channel, the interval the bytes and scale of summarize describe, s (c_q -+ r_q), holds
    every key of the block (the centre's rounding error is in the radius, rounded up): so the bound
    is above every q . k, whatever the query, as the native kernel's is."""
    tokens = 12 * B
    keys = torch.randn(tokens, HKV, D, generator=torch.Generator().manual_seed(8))
    table = torch.randperm(20, generator=torch.Generator().manual_seed(9))[:12].to(torch.int32)
    sel = TritonSelector(SCORINGS["bound-int8"], 20, B, HKV, D, DEVICE)
    fills = torch.full((12,), B, dtype=torch.int32)
    sel.summarize(flash_cache(keys, table, 20).to(DEVICE), table.to(DEVICE), fills.to(DEVICE))
    rep, scale = sel.rep.cpu()[table.long()].double(), sel.rep_scale.cpu()[table.long()].double()[..., None]
    centre, radius = (rep[:, :, 0] - 128) * scale, rep[:, :, 1] * scale  # (blocks, Hkv, D)
    blocks = keys.double().view(12, B, HKV, D)
    assert torch.all(centre - radius <= blocks.amin(1)) and torch.all(centre + radius >= blocks.amax(1))


@pytest.mark.parametrize("name", SCORINGS)
@pytest.mark.parametrize("mass", [0.0, 0.8])
def test_selection_keeps_the_windows_and_the_best_blocks_per_head_as_the_native_kernel(name, mass):
    scoring = SCORINGS[name]
    tokens = 23 * B + 9
    sel, native, table = selector_for(scoring, tokens, 60, seed=1)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(2))
    tables = table[None].contiguous()
    n, ids = table.numel(), table.tolist()
    budget = n if mass else 9  # adaptive: the share decides, not the cap
    got, got_kept, got_scores = run(sel, q, tables, [tokens], [budget], mass=mass)
    want, want_kept, _ = run(native, q, tables, [tokens], [budget], mass=mass)
    fills = [min(B, tokens - i * B) for i in range(n)]
    rep, rep_scale = sel.rep.cpu(), sel.rep_scale.cpu()
    # what the reference reads: the representation (and the int8 scales)
    summaries = [(rep[p], rep[p], rep[p], rep_scale[p]) if sel.quantized else (rep[p], rep[p]) for p in ids]
    forced = {0, n - 2, n - 1}
    for h in range(HKV):
        ref = reference.group_scores(scoring, q[0], summaries, fills, h, HKV, SCALE, sel.dtype)
        torch.testing.assert_close(got_scores[h, :n], ref, rtol=2e-3, atol=1e-6)
        k = int(got_kept[h])
        rows = got[h, :k]
        assert torch.all(rows % HKV == h)
        logical = [ids.index(p) for p in (rows // HKV).tolist()]
        assert logical == sorted(logical) and forced <= set(logical)
        chosen, rest = set(logical) - forced, set(range(n)) - set(logical)
        if chosen and rest:
            assert min(ref[list(chosen)]) >= max(ref[list(rest)]) * (1 - 1e-3)
        if mass:  # the fewest: without its weakest chosen block the share falls short of the target
            assert float(ref[logical].sum()) >= mass * (H // HKV) * (1 - 1e-3)
            weakest = min(chosen, key=lambda blk: float(ref[blk]))
            assert float(ref[logical].sum() - ref[weakest]) < mass * (H // HKV)
        else:
            assert k == 9
        # The native kernel on the same keys agrees, but for a near tie that one ulp of the
        # interpreter's bfloat16 rounding can flip.
        native_rows = set(want[h, : int(want_kept[h])].tolist())
        assert abs(k - int(want_kept[h])) <= 1 and len(native_rows & set(rows.tolist())) >= k - 1


def test_several_requests_with_their_own_tables_budgets_and_rows():
    scoring = SCORINGS["both"]
    g = torch.Generator().manual_seed(9)
    blocks, lens, budgets = 50, [11 * B + 3, 20 * B, 5 * B + 1], [4, 7, 5]
    keys = [torch.randn(n, HKV, D, generator=g).to(torch.bfloat16) for n in lens]
    perm = torch.randperm(blocks, generator=g).to(torch.int32)
    width = max(-(-n // B) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    start = 0
    sel = TritonSelector(scoring, blocks, B, HKV, D, DEVICE)
    for r, n in enumerate(lens):
        m = -(-n // B)
        tables[r, :m] = perm[start : start + m]
        start += m
        fills = torch.tensor([min(B, n - i * B) for i in range(m)], dtype=torch.int32)
        cache = flash_cache(keys[r], tables[r, :m], blocks).to(DEVICE)
        sel.summarize(cache, tables[r, :m].contiguous().to(DEVICE), fills.to(DEVICE))
    q = torch.randn(len(lens), H, D, generator=g)
    out, kept, _ = run(sel, q, tables, lens, budgets)
    for r, n in enumerate(lens):
        m = -(-n // B)
        for h in range(HKV):
            rows = out[r * HKV + h, : budgets[r]]
            assert int(kept[r * HKV + h]) == budgets[r]
            assert torch.all(rows % HKV == h)
            logical = [tables[r, :m].tolist().index(p) for p in (rows // HKV).tolist()]
            assert logical == sorted(logical) and {0, m - 2, m - 1} <= set(logical)


def test_unported_scorings_are_refused_by_name():
    with pytest.raises(ValueError, match="hash"):
        TritonSelector(Scoring("hash", hash_bits=32), 4, B, HKV, D, "cpu")
    with pytest.raises(ValueError, match="blk_repre_dim_prune_ratio"):
        TritonSelector(Scoring("mean", keep_channels=0.5), 4, B, HKV, D, "cpu")
    with pytest.raises(ValueError, match="int8 summaries score the bound only"):
        TritonSelector(Scoring("both", dtype=QUANTIZED), 4, B, HKV, D, "cpu")


def test_a_prior_is_added_to_each_block_score_by_physical_block_and_head():
    tokens = 12 * B + 5
    sel, _, table = selector_for(SCORINGS["both"], tokens, 30, seed=4)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(5))
    prior = torch.rand(30, HKV, generator=torch.Generator().manual_seed(6))
    tables, n = table[None].contiguous(), table.numel()
    _, _, plain = run(sel, q, tables, [tokens], [n])
    _, _, primed = run(sel, q, tables, [tokens], [n], prior=prior)
    want = plain.view(HKV, -1)[:, :n] + prior[table.long()].T
    torch.testing.assert_close(primed.view(HKV, -1)[:, :n], want)


def test_ties_at_the_threshold_go_to_the_lower_blocks_as_in_the_native_kernel():
    """A budget below the windows' three blocks (all ranked first, tied): the lowest of them."""
    tokens = 9 * B + 1
    sel, native, table = selector_for(SCORINGS["bound"], tokens, 20, seed=7)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(8))
    tables = table[None].contiguous()
    got, got_kept, _ = run(sel, q, tables, [tokens], [2])
    want, want_kept, _ = run(native, q, tables, [tokens], [2])
    assert torch.equal(got_kept, want_kept)
    assert torch.equal(got[:, :2], want[:, :2])
    assert [int(r) // HKV for r in got[0, :2]] == [int(table[0]), int(table[table.numel() - 2])]


def attend_kept(q, keys, values, rows, kept, tables, lens):
    """Attention of each request's query over exactly its kept blocks, per KV head (the reference)."""
    out = torch.zeros(len(lens), H, D)
    for r, seq in enumerate(lens):
        n = -(-seq // B)
        last = int(tables[r, n - 1])
        for h in range(HKV):
            blocks = [int(x) // HKV for x in rows[r * HKV + h, : int(kept[r * HKV + h])]]
            k = torch.cat([keys[p, : (seq - (n - 1) * B if p == last else B), h] for p in blocks]).float()
            v = torch.cat([values[p, : (seq - (n - 1) * B if p == last else B), h] for p in blocks]).float()
            for j in range(H // HKV):
                w = torch.softmax(q[r, h * (H // HKV) + j].float() @ k.T * SCALE, -1)
                out[r, h * (H // HKV) + j] = w @ v
    return out


@pytest.mark.parametrize("kept_share", [0.3, 1.0])
def test_sparse_decode_attends_exactly_the_kept_blocks_of_each_head(kept_share):
    """Requests of different lengths (partial last blocks), shuffled tables, several splits each."""
    g = torch.Generator().manual_seed(11)
    lens, blocks = [70 * B + 5, 9 * B, 40 * B + 31], 200
    width = max(-(-n // B) for n in lens)
    keys = torch.randn(blocks, B, HKV, D, generator=g).to(torch.bfloat16)
    values = torch.randn(blocks, B, HKV, D, generator=g).to(torch.bfloat16)
    perm = torch.randperm(blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    start = 0
    sel = TritonSelector(SCORINGS["both"], blocks, B, HKV, D, DEVICE)
    for r, n in enumerate(lens):
        m = -(-n // B)
        tables[r, :m] = perm[start : start + m]
        start += m
        fills = torch.tensor([min(B, n - i * B) for i in range(m)], dtype=torch.int32)
        sel.summarize(keys.to(DEVICE), tables[r, :m].contiguous().to(DEVICE), fills.to(DEVICE))
    q = torch.randn(len(lens), H, D, generator=g).to(torch.bfloat16).float()  # exact in TF32 on a GPU
    budgets = [max(3, int(kept_share * -(-n // B))) for n in lens]
    rows, kept, _ = run(sel, q, tables, lens, budgets)
    assert kept_share < 1 or kept.tolist() == [-(-n // B) for n in lens for _ in range(HKV)]
    got = sparse_decode(
        q.to(DEVICE),
        torch.arange(len(lens), dtype=torch.int32, device=DEVICE),
        keys.to(DEVICE),
        values.to(DEVICE),
        rows.to(DEVICE),
        kept.to(DEVICE),
        tables.to(DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        SCALE,
    )
    assert got.dtype == q.dtype
    want = attend_kept(q, keys, values, rows, kept, tables, lens)
    torch.testing.assert_close(got.cpu(), want, rtol=3e-3, atol=3e-3)  # the weights pass TF32 on a GPU
