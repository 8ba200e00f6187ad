"""UCM inside vLLM. ``kv_connector_module_path: ucm.integration.vllm`` loads :class:`UCMConnector`."""

from ucm.integration.vllm.connector import UCMConnector

__all__ = ["UCMConnector"]
