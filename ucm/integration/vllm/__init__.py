"""UCM inside vLLM. ``kv_connector_module_path: ucm.integration.vllm`` loads :class:`UCMConnector`.

The connector is imported lazily (PEP 562): deployment tooling imports the config helpers here
(e.g. :func:`~ucm.integration.vllm.config.kv_transfer_config`) without installing vLLM.
"""

from typing import Any

__all__ = ["UCMConnector"]


def __getattr__(name: str) -> Any:
    if name == "UCMConnector":
        from ucm.integration.vllm.connector import UCMConnector

        return UCMConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
