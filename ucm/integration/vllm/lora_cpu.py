"""Base-model tokens in a batch with LoRA requests, on vLLM's CPU build: computed without an adapter.

vLLM marks a token that runs no adapter with the slot index -1. Its GPU kernels skip such tokens;
the PyTorch ops its CPU build runs instead (``vllm.lora.ops.torch_ops``, vLLM 0.32) select the
adapter weights with ``weights[indices]``, where -1 is the *last* slot: whenever a base-model
request shares a batch with adapter requests and the last slot holds an adapter, the base request is
computed with that adapter. Its answer is wrong, and so is its KV — which the connector would store
under the base model's block ids, for every engine to load. (A batch of base requests alone runs no
LoRA op; an adapter request is unaffected.)

:func:`install` replaces the three row-wise ops (the sequence-wise ones call them) with versions that
leave the rows of index -1 as they were, as the GPU kernels do. UCM's vLLM plugin installs it in
every engine process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

ROW_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def skipping_unadapted_rows(op: Callable[..., None]) -> Callable[..., None]:
    """``op`` (inputs, weights, output, indices, ...) with the output rows of index < 0 untouched."""

    @functools.wraps(op)
    def run(
        inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, indices: torch.Tensor, *rest: Any, **kw: Any
    ) -> None:
        unadapted = indices < 0
        if not bool(unadapted.any()) or unadapted.shape[0] != output.shape[0]:
            op(inputs, weights, output, indices, *rest, **kw)
            return
        kept = output[unadapted].clone()
        op(inputs, weights, output, indices.clamp(min=0), *rest, **kw)
        output[unadapted] = kept

    run.ucm_skips_unadapted_rows = True  # type: ignore[attr-defined]
    return run


def install() -> None:
    """Every binding of the row-wise ops vLLM's CPU LoRA path calls: the ops module's own (its
    sequence-wise ops call them), the package's and the CPU punica wrapper's imports."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in ROW_OPS:
        op = getattr(lora_ops, name)
        if getattr(op, "ucm_skips_unadapted_rows", False):
            continue  # vLLM runs plugins once per process, maybe more
        fixed = skipping_unadapted_rows(op)
        for module in (lora_ops, torch_ops, punica_cpu):
            setattr(module, name, fixed)
