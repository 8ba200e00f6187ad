"""Where RoPE-related sparse helpers must be exact, they are: ReRoPE inside its window is plain RoPE
attention; Blend recomputes the most deviant tokens (its re-rotation is checked against a fresh
computation in tests/connector/test_blend_compute.py)."""

import math

import torch

from tests.sparse.reference import attention_over
from ucm.sparse.blend import select_recompute
from ucm.sparse.rerope import rerope_attention
from ucm.sparse.rope import apply_rope

H, HKV, D = 8, 2, 64


def test_blend_recomputes_the_most_deviant_tokens():
    reused = torch.zeros(8, HKV, D)
    fresh = torch.zeros(8, HKV, D)
    fresh[[2, 6]] = 5.0
    fresh[4] = 0.1
    assert select_recompute(reused, fresh, 0.25).tolist() == [2, 6]
    assert select_recompute(reused, fresh, 0.375).tolist() == [2, 4, 6]
    assert select_recompute(reused, fresh, 0.0).tolist() == []
    assert select_recompute(reused, fresh, 1.0).tolist() == list(range(8))


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
