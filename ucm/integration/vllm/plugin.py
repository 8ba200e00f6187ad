"""The ``vllm.general_plugins`` entry point: vLLM runs it in each of its processes at startup.

It registers UCMConnector under the names UCM's documentation uses (``UCMDirectConnector``, ...), so
``--kv-transfer-config '{"kv_connector": "UCMDirectConnector", ...}'`` needs no module path, and it
puts :class:`ucm.integration.vllm.attention.UCMAttentionBackend` in place of vLLM's CPU
attention backend. Without a sparse configuration that class is the CPU backend unchanged, so
engines that do not ask for sparse attention behave exactly as before. It also registers the model
class Blend needs (:mod:`ucm.integration.vllm.blend_model`), used only by engines that name it, and
mends vLLM's CPU LoRA ops so that base-model tokens batched with adapter requests run no adapter
(:mod:`ucm.integration.vllm.lora_cpu`), and on the CPU platform it makes vLLM's processes wait for
each other's messages asleep instead of spinning (:mod:`ucm.integration.vllm.cpu_wait`) and forks
the engine core from the API server instead of starting it afresh (:mod:`ucm.integration.vllm.cpu_start`).
``VLLM_PLUGINS`` (a list of plugin names to load) turns the plugin off altogether.
"""

from __future__ import annotations

BACKEND = "ucm.integration.vllm.attention.UCMAttentionBackend"
BLEND_MODEL = "ucm.integration.vllm.blend_model:UCMBlendLlamaForCausalLM"


def register() -> None:
    from vllm import ModelRegistry
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ucm.integration.vllm import cpu_start, cpu_wait, lora_cpu
    from ucm.integration.vllm.config import BLEND_ARCHITECTURE
    from ucm.ucm_style import CONNECTOR_NAMES

    lora_cpu.install()
    cpu_wait.install()
    cpu_start.install()

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    ModelRegistry.register_model(BLEND_ARCHITECTURE, BLEND_MODEL)
    for name in CONNECTOR_NAMES:
        if name not in KVConnectorFactory._registry:  # vLLM runs plugins once per process, maybe more
            KVConnectorFactory.register_connector(name, "ucm.integration.vllm", name)
