"""vLLM's CPU LoRA ops, mended: rows of tokens that run no adapter (slot index -1) are left as they
were, as vLLM's GPU kernels leave them, instead of getting the last slot's adapter."""

from __future__ import annotations

import torch

from ucm.integration.vllm import lora_cpu

SLOTS, RANK, HIDDEN, OUT = 3, 4, 8, 6


def weights(*shape: int) -> torch.Tensor:
    return torch.arange(1, 1 + torch.tensor(shape).prod().item(), dtype=torch.float32).reshape(shape) / 100


def test_unadapted_rows_are_untouched_and_the_others_computed_as_before():
    from vllm.lora.ops.torch_ops import lora_ops

    original = (
        lora_ops.bgmv_shrink.__wrapped__ if hasattr(lora_ops.bgmv_shrink, "__wrapped__") else lora_ops.bgmv_shrink
    )
    fixed = lora_cpu.skipping_unadapted_rows(original)
    x, a = weights(4, HIDDEN), weights(SLOTS, 1, RANK, HIDDEN)
    indices = torch.tensor([0, -1, 2, -1])
    expected, out = torch.full((4, RANK), 7.0), torch.full((4, RANK), 7.0)
    original(x, a, expected, indices, 0.5)
    fixed(x, a, out, indices, 0.5)
    assert torch.equal(out[[0, 2]], expected[[0, 2]])
    assert torch.equal(out[[1, 3]], torch.full((2, RANK), 7.0))  # not the last slot's adapter
    assert not torch.equal(expected[1], torch.full((RANK,), 7.0))  # which vLLM's op applied


def test_installed_everywhere_the_cpu_path_calls_them_once():
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    lora_cpu.install()
    lora_cpu.install()  # vLLM may run plugins more than once
    for name in lora_cpu.ROW_OPS:
        op = getattr(lora_ops, name)
        assert op.ucm_skips_unadapted_rows
        assert getattr(torch_ops, name) is op and getattr(punica_cpu, name) is op
        assert not getattr(op.__wrapped__, "ucm_skips_unadapted_rows", False)  # wrapped once
    b = weights(SLOTS, 1, OUT, RANK)
    y = torch.zeros(2, OUT)
    lora_ops.sgmv_expand(  # a prefill of two sequences, one token each: the second runs no adapter
        weights(2, RANK), b, y, torch.tensor([0, 1]), torch.tensor([1, 1]), torch.tensor([1, -1]), 2, 1, 2
    )
    assert y[0].abs().sum() > 0 and torch.equal(y[1], torch.zeros(OUT))
