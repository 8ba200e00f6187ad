"""The model class Blend computes with: vLLM's Llama, remembered when built.

vLLM hands a KV connector the paged cache, never the model, but blending runs the model's own layers
over a region. UCM's plugin registers this class as ``config.BLEND_ARCHITECTURE``; an engine that
blends names it with ``--hf-overrides '{"architectures": ["UCMBlendLlamaForCausalLM"]}'`` (``ucm serve``
adds that when ``blend`` is configured). It is vLLM's class unchanged but for that one reference,
so serving is otherwise identical.
"""

from __future__ import annotations

import weakref

from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaForCausalLM

_built: list[weakref.ref[nn.Module]] = []


class UCMBlendLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        _built.append(weakref.ref(self))


def built_model() -> nn.Module | None:
    """The model this process built last, if it is alive."""
    while _built:
        model = _built[-1]()
        if model is not None:
            return model
        _built.pop()
    return None
