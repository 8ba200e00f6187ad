"""Where sparse attention must be exact, it is: full budgets equal dense attention, online softmax
equals softmax, RoPE correction equals recomputation, Hamming top-k equals brute force, and
prefetched bytes equal the store's."""

import math

import pytest
import torch

from ucm.sparse.base import BlockMeta, PagedKV, all_blocks, dense_attention, sparse_attention, topk_with_windows
from ucm.sparse.blend import CachedChunk, Match, blend, classify, correct_positions, select_recompute
from ucm.sparse.esa import ESA, ESAConfig
from ucm.sparse.gsa import GSA, GSAConfig, PrefetchEngine
from ucm.sparse.gsa_ondevice import GSAOnDevice, GSAOnDeviceConfig, hamming, pack_signs
from ucm.sparse.kvstar import KVStar, KVStarConfig
from ucm.sparse.psa import PSA, OnlineSoftmax, PSAConfig
from ucm.sparse.rerope import rerope_attention
from ucm.sparse.rope import apply_rope
from ucm.store import create_store

H, HKV, D, B = 8, 2, 64, 16


def make_kv(n_tokens: int, seed: int = 0) -> tuple[torch.Tensor, PagedKV]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_tokens, HKV, D, generator=g)
    values = torch.randn(n_tokens, HKV, D, generator=g)
    q = torch.randn(H, D, generator=g)
    kv = PagedKV.from_dense(keys, values, B)
    # scramble the physical layout: block tables must be honoured
    perm = torch.randperm(kv.keys.shape[0], generator=g)
    inv = torch.argsort(perm)
    return q, PagedKV(kv.keys[perm], kv.values[perm], inv[kv.block_table], n_tokens)


def reference(q: torch.Tensor, kv: PagedKV) -> torch.Tensor:
    """Token-by-token softmax, independent of the block machinery."""
    keys = torch.cat([kv.block_keys(i) for i in range(kv.num_blocks)])
    values = torch.cat([kv.values[kv.block_table[i], : len(kv.block_keys(i))] for i in range(kv.num_blocks)])
    out = torch.empty_like(q)
    g = H // HKV
    for h in range(H):
        kvh = h // g
        w = torch.softmax(keys[:, kvh] @ q[h] / math.sqrt(D), 0)
        out[h] = w @ values[:, kvh]
    return out


@pytest.mark.parametrize("n_tokens", [1, 16, 37, 200])
def test_dense_attention_matches_token_softmax(n_tokens):
    q, kv = make_kv(n_tokens)
    torch.testing.assert_close(dense_attention(q, kv), reference(q, kv), rtol=1e-5, atol=1e-5)


def test_padding_entries_are_ignored():
    q, kv = make_kv(100)
    sel = all_blocks(kv)
    padded = torch.cat([sel, torch.full((HKV, 3), -1)], dim=1)
    torch.testing.assert_close(sparse_attention(q, kv, padded), dense_attention(q, kv))


@pytest.mark.parametrize("background", [False, True])
def test_esa_full_budget_is_dense(background):
    q, kv = make_kv(150)
    esa = ESA(ESAConfig(sparse_ratio=1.0, min_blocks=1, background=background))
    meta = BlockMeta.of(kv)
    for step in range(3):
        torch.testing.assert_close(sparse_attention(q, kv, esa.select(q, kv, meta, step)), dense_attention(q, kv))
    esa.close()


def test_esa_keeps_windows_and_reuses_between_retrievals():
    q, kv = make_kv(320)
    esa = ESA(ESAConfig(sparse_ratio=0.25, min_blocks=2, init_window_sz=1, local_window_sz=2, retrieval_stride=4))
    meta = BlockMeta.of(kv)
    sel = esa.select(q, kv, meta, 0)
    n = kv.num_blocks
    for row in sel:
        assert {0, n - 2, n - 1} <= set(row.tolist())
        assert len(row) == math.ceil(0.25 * n)
    esa.select(q, kv, meta, 1)
    esa.select(q, kv, meta, 2)
    assert esa.retrievals == 1
    esa.select(q, kv, meta, 4)
    assert esa.retrievals == 2


def test_block_meta_is_incremental():
    _, kv = make_kv(40)
    meta = BlockMeta.of(kv)
    assert meta.updates == 3  # blocks 0, 1 full; 2 partial
    grown = PagedKV(kv.keys, kv.values, kv.block_table, 48)
    meta.update(grown)
    assert meta.updates == 4  # only the block that changed
    fresh = BlockMeta.of(grown)
    torch.testing.assert_close(meta.mean, fresh.mean)
    torch.testing.assert_close(meta.kmax, fresh.kmax)


def test_psa_with_eps_one_is_exact_and_attends_everything():
    q, kv = make_kv(333)
    out, used = PSA(PSAConfig(eps=1.0, microbatch=3)).attend(q, kv, BlockMeta.of(kv))
    torch.testing.assert_close(out, dense_attention(q, kv), rtol=1e-5, atol=1e-5)
    assert used.tolist() == [kv.num_blocks] * HKV


def test_psa_online_softmax_merge_equals_full_softmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(HKV, 4, 90, generator=g) * 5
    v = torch.randn(HKV, 90, D, generator=g)
    state = OnlineSoftmax.empty(HKV, 4, D, torch.device("cpu"), torch.float32)
    for lo, hi in ((0, 7), (7, 40), (40, 41), (41, 90)):
        state.add(logits[..., lo:hi], v[:, lo:hi])
    expected = torch.einsum("hgt,htd->hgd", torch.softmax(logits, -1), v)
    torch.testing.assert_close(state.result(), expected, rtol=1e-5, atol=1e-5)


def test_psa_stops_early_when_attention_is_concentrated():
    q, kv = make_kv(512)
    # one block holds keys aligned with the queries: nearly all mass lands there
    hot = kv.block_table[5]
    # strong enough that its exact score beats the loose min/max bounds of random blocks
    kv.keys[hot] = q.view(HKV, H // HKV, D).mean(1)[None].expand(B, -1, -1) * 12
    out, used = PSA(PSAConfig(eps=0.95, microbatch=2)).attend(q, kv, BlockMeta.of(kv))
    assert used.max() < kv.num_blocks // 2
    rel = (out - dense_attention(q, kv)).norm() / dense_attention(q, kv).norm()
    assert rel < 0.1


def test_kvstar_full_budget_is_dense_and_prunes_dimensions():
    q, kv = make_kv(200)
    star = KVStar(KVStarConfig(sparse_ratio=1.0, min_blocks=1, blk_repre_dim_prune_ratio=0.25, retrieval_stride=2))
    meta = BlockMeta.of(kv)
    torch.testing.assert_close(sparse_attention(q, kv, star.select(q, kv, meta, 0)), dense_attention(q, kv))
    star.select(q, kv, meta, 1)
    assert star.retrievals == 1


def test_gsa_full_budget_is_dense():
    q, kv = make_kv(120)
    sel = GSA(GSAConfig(sparse_ratio=1.0, min_blocks=1)).select(q, kv, BlockMeta.of(kv))
    torch.testing.assert_close(sparse_attention(q, kv, sel), dense_attention(q, kv))


def test_hashes_and_hamming_topk_match_brute_force():
    q, kv = make_kv(96, seed=5)
    gsa = GSAOnDevice(
        D, GSAOnDeviceConfig(hash_bits=32, sparse_ratio=0.5, min_blocks=1, init_window_sz=0, local_window_sz=0)
    )
    dist = gsa.block_distances(q, kv)
    proj = gsa.projection
    keys = torch.cat([kv.block_keys(i) for i in range(kv.num_blocks)])
    g = H // HKV
    for kvh in range(HKV):
        for blk in range(kv.num_blocks):
            total = 0
            for h in range(kvh * g, (kvh + 1) * g):
                qb = [bool(x > 0) for x in q[h] @ proj]
                best = min(
                    sum(a != bool(x > 0) for a, x in zip(qb, keys[t, kvh] @ proj, strict=True))
                    for t in range(blk * B, min((blk + 1) * B, kv.num_tokens))
                )
                total += best
            assert dist[kvh, blk] == total
    sel = gsa.select(q, kv, None)
    k = sel.shape[1]
    for kvh in range(HKV):
        chosen = set(sel[kvh].tolist())
        worst_chosen = max(dist[kvh, list(chosen)])
        assert all(dist[kvh, b] >= worst_chosen for b in range(kv.num_blocks) if b not in chosen)
        assert len(chosen) == k


def test_hash_cache_only_hashes_new_tokens():
    _, kv = make_kv(40)
    gsa = GSAOnDevice(D)
    gsa.update(kv)
    assert gsa.hashed_tokens == 40
    before = gsa.update(kv).clone()
    grown = PagedKV(kv.keys, kv.values, kv.block_table, 48)
    after = gsa.update(grown)
    assert torch.equal(after[:40], before) and after.shape[0] == 48


def test_pack_signs_and_hamming():
    x = torch.tensor([[1.0, -1, 1, -1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1]])
    packed = pack_signs(x)
    assert packed.tolist() == [[0b00000101, 0xFF]]
    assert hamming(packed, pack_signs(-x)).item() == 16


def test_rope_correction_equals_recomputation():
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(10, HKV, D, generator=g)
    at_p = apply_rope(raw, torch.arange(100, 110))
    at_q = apply_rope(raw, torch.arange(7, 17))
    torch.testing.assert_close(correct_positions(at_p, 100, 7), at_q, rtol=1e-5, atol=1e-5)


def test_blend_classifies_chunks_and_recomputes_the_most_deviant_tokens():
    cached = [
        CachedChunk((1, 2, 3, 4), torch.zeros(4, 1, 2), torch.zeros(4, 1, 2), 0),
        CachedChunk((9, 9), torch.zeros(2, 1, 2), torch.zeros(2, 1, 2), 4),
    ]
    assert classify([1, 2, 3, 4], cached)[0] == Match.FULL
    match, chunk, n = classify([1, 2, 7, 7], cached)
    assert (match, chunk.tokens, n) == (Match.PARTIAL, (1, 2, 3, 4), 2)
    assert classify([5, 6], cached)[0] == Match.NONE
    reused = torch.zeros(8, HKV, D)
    fresh = torch.zeros(8, HKV, D)
    fresh[[2, 6]] = 5.0
    fresh[4] = 0.1
    idx = select_recompute(reused, fresh, 0.25)
    assert idx.tolist() == [2, 6]
    merged = blend(reused, fresh, idx)
    assert torch.equal(merged[[2, 6]], fresh[[2, 6]]) and not merged[4].any()
    torch.testing.assert_close(blend(reused, fresh, select_recompute(reused, fresh, 1.0)), fresh)


def test_rerope_is_plain_rope_inside_the_window_and_clamps_beyond():
    g = torch.Generator().manual_seed(2)
    n = 40
    keys, values = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    q = torch.randn(H, D, generator=g)
    q_pos = n - 1
    # window beyond the context: ordinary RoPE attention
    qr = apply_rope(q.view(HKV, -1, D), torch.full((HKV,), q_pos)).reshape(H, D)
    kr = apply_rope(keys, torch.arange(n))
    dense = dense_attention(qr, PagedKV.from_dense(kr, values, B))
    torch.testing.assert_close(rerope_attention(q, q_pos, keys, values, window=1000), dense, rtol=1e-4, atol=1e-4)
    # a small window: every key farther than it is seen at distance exactly `window`
    out = rerope_attention(q, q_pos, keys, values, window=8)
    far_q = apply_rope(q.view(HKV, -1, D), torch.full((HKV,), 8)).reshape(H, D)
    near_q = qr
    logits = []
    for j in range(n):
        qq = near_q if q_pos - j < 8 else far_q
        kk = kr[j] if q_pos - j < 8 else keys[j]
        logits.append(torch.einsum("hd,hd->h", qq, kk.repeat_interleave(H // HKV, 0)) / math.sqrt(D))
    w = torch.softmax(torch.stack(logits, 1), 1)
    expected = torch.einsum("ht,thd->hd", w, values.repeat_interleave(H // HKV, 1))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_topk_with_windows_never_drops_windows():
    scores = torch.tensor([[0.0, 5, 1, 9, 2, 3, 0]])
    # k counts the windows: 3 = sink 0 + local 6 + the best of the rest
    assert topk_with_windows(scores, 3, 1, 1).tolist() == [[0, 3, 6]]
    assert topk_with_windows(scores, 1, 1, 1).tolist() == [[0, 6]]  # windows are never dropped


def test_prefetch_returns_exactly_the_store_bytes_and_counts_hits(tmp_path):
    store = create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}})
    ids = [bytes([i]) * 16 for i in range(6)]
    data = [bytes([i]) * 4096 for i in range(6)]
    store.wait(store.dump(ids, data))
    engine = PrefetchEngine(store, 4096, slots=4)
    engine.prefetch(ids[:3], priority=0)
    got = engine.get(ids[:3])
    assert [bytes(b) for b in got] == data[:3]
    assert (engine.hits, engine.misses) == (3, 0)
    got = engine.get([ids[4], b"missing" * 2])
    assert bytes(got[0]) == data[4] and got[1] is None
    assert engine.misses == 2
    engine.close()
    store.close()


def test_upper_bounds_bound_every_score():
    from ucm.sparse.psa import upper_bounds

    q, kv = make_kv(300, seed=9)
    meta = BlockMeta.of(kv)
    bounds = upper_bounds(q, meta)  # (Hkv, G, n)
    g = H // HKV
    for blk in range(kv.num_blocks):
        keys = kv.block_keys(blk)
        for h in range(H):
            assert (keys[:, h // g] @ q[h]).max() <= bounds[h // g, h % g, blk] + 1e-4
