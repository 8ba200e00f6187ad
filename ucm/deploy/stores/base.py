"""One kind of shared KV store, as a deployment knows it.

A kind owns everything the deployment layer knows about it: its options in ``spec.store`` (a model,
under one field), the connector's store configuration it becomes on each site, the volumes engines
mount, a claim the deployment owns, extra roles it runs (Mooncake's master), how status describes
a store nothing here watches, and which of its options mean something only in Kubernetes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from ucm.deploy.roles import Role, Site, Volume
from ucm.deploy.schema import Spec


class StoreKind(ABC):
    name: ClassVar[str]  # the value of spec.store.type
    field: ClassVar[str]  # spec.store.<field> holds the options
    options: ClassVar[type[Spec]]
    description: ClassVar[str]  # for the CRD's documentation of the field
    signs_blocks: ClassVar[bool] = False  # block files carry a trailer that can hold a MAC (store.mac)

    @abstractmethod
    def connector(self, opts: Any, deployment: str, site: Site) -> dict[str, Any]:
        """The connector's store stage: ``{backend name: options}`` (``ucm.store`` registry names)."""

    def roles(self, opts: Any, deployment: str, site: Site) -> list[Role]:
        return []

    def volumes(self, opts: Any, deployment: str, site: Site) -> list[Volume]:
        """What engine pods mount to reach the store (nothing locally: paths are this machine's)."""
        return []

    def claim(self, opts: Any, site: Site) -> dict[str, Any] | None:
        """A PersistentVolumeClaim spec the deployment creates and owns."""
        return None

    def retained(self, opts: Any) -> bool:
        """Whether that claim outlives the deployment (no owner reference; never deleted by it)."""
        return False

    def known_size(self, opts: Any) -> int | None:
        """The volume's size in bytes where the deployment knows it (a claim it creates)."""
        return None

    def external(self, opts: Any) -> str | None:
        """How status describes a store nothing in the deployment runs or claims."""
        return None

    def kubernetes_only(self, opts: Any) -> list[str]:
        """Options ``ucm up`` ignores, each with why, as ``field (reason)``."""
        return []
