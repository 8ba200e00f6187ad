"""``type: nfs``: the POSIX layout on an NFS export that engine pods mount directly."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ucm.deploy.roles import Site, Volume
from ucm.deploy.schema import Spec
from ucm.deploy.stores.base import StoreKind


class NFSSpec(Spec):
    server: str = Field(min_length=1, description="The NFS server's host name or IP address")
    path: str = Field(min_length=1, description="The exported directory, mounted by every engine pod")


class Nfs(StoreKind):
    name = "nfs"
    field = "nfs"
    options = NFSSpec
    description = "The NFS export holding the blocks (type nfs)"
    signs_blocks = True

    def connector(self, opts: NFSSpec, deployment: str, site: Site) -> dict[str, Any]:
        return {"nfs": {"roots": [site.kv_dir]}}

    def volumes(self, opts: NFSSpec, deployment: str, site: Site) -> list[Volume]:
        if site.local:
            return []
        return [Volume("kv", site.kv_dir, {"nfs": {"server": opts.server, "path": opts.path}})]

    def external(self, opts: NFSSpec) -> str | None:
        return f"NFS {opts.server}:{opts.path}"

    def kubernetes_only(self, opts: NFSSpec) -> list[str]:
        return ["store.nfs (blocks go to the run directory)"]
