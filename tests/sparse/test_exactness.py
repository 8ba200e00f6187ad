"""Where RoPE-related sparse helpers must be exact, they are: RoPE correction equals recomputation,
ReRoPE inside its window is plain RoPE attention, Blend recomputes the most deviant tokens."""

import math

import torch

from tests.sparse.reference import attention_over
from ucm.sparse.blend import CachedChunk, Match, blend, classify, correct_positions, select_recompute
from ucm.sparse.rerope import rerope_attention
from ucm.sparse.rope import apply_rope

H, HKV, D = 8, 2, 64


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
    g = H // HKV
    dense = torch.cat([attention_over(qr[h * g : (h + 1) * g], kr[:, h], values[:, h]) for h in range(HKV)]).float()
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
