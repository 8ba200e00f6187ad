"""KV block stores: one protocol (:class:`Store`), many backends, composed by configuration."""

from ucm.store.base import BlockInfo, Store, StoreError, Task
from ucm.store.factory import REGISTRY, create_store, validate_store_config

__all__ = ["REGISTRY", "BlockInfo", "Store", "StoreError", "Task", "create_store", "validate_store_config"]
