"""Store kinds by ``spec.store.type``. A new kind is one module here plus one line below, and its
tests; the spec (``ucm.deploy.spec``), the plan, both executors and status read only this registry."""

from __future__ import annotations

from ucm.deploy.stores.base import StoreKind
from ucm.deploy.stores.ds3fs import Ds3fs
from ucm.deploy.stores.mooncake import Mooncake
from ucm.deploy.stores.nfs import Nfs
from ucm.deploy.stores.posix import Posix

KINDS: dict[str, StoreKind] = {k.name: k for k in (Posix(), Nfs(), Ds3fs(), Mooncake())}

__all__ = ["KINDS", "StoreKind"]
