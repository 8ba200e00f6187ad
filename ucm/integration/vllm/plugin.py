"""The ``vllm.general_plugins`` entry point: vLLM runs it in each of its processes at startup.

It puts :class:`ucm.integration.vllm.attention.UCMAttentionBackend` in place of vLLM's CPU
attention backend. Without a sparse configuration that class is the CPU backend unchanged, so
engines that do not ask for sparse attention behave exactly as before; ``VLLM_PLUGINS`` (a list of
plugin names to load) turns the plugin off altogether.
"""

from __future__ import annotations

BACKEND = "ucm.integration.vllm.attention.UCMAttentionBackend"


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
