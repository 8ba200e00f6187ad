"""UCM inside vLLM. ``kv_connector_module_path: ucm.integration.vllm`` loads :class:`UCMConnector`.

The connector is imported lazily (PEP 562): deployment tooling imports the config helpers here
(e.g. :func:`~ucm.integration.vllm.config.kv_transfer_config`) without installing vLLM.
"""

from typing import Any

__all__ = ["UCMConnector", "UCMDirectConnector", "UnifiedCacheConnectorV1"]


def __getattr__(name: str) -> Any:
    # UCM's documentation names the connector UCMDirectConnector or UnifiedCacheConnectorV1: one class.
    if name in __all__:
        from ucm.integration.vllm.connector import UCMConnector

        return UCMConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
