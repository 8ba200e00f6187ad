"""``type: ds3fs``: the POSIX layout on a 3FS FUSE mount present on every node."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ucm.deploy.roles import Site, Volume
from ucm.deploy.schema import Spec
from ucm.deploy.stores.base import StoreKind


class DS3FSSpec(Spec):
    mount_path: str = Field(min_length=1, description="Where the 3FS FUSE mount is on the nodes")


class Ds3fs(StoreKind):
    name = "ds3fs"
    field = "ds3fs"
    options = DS3FSSpec
    description = "The 3FS mount holding the blocks (type ds3fs)"
    signs_blocks = True

    def connector(self, opts: DS3FSSpec, deployment: str, site: Site) -> dict[str, Any]:
        # Locally the mount is used where it is; in pods it is mounted at the site's KV directory.
        return {"ds3fs": {"roots": [opts.mount_path if site.local else site.kv_dir]}}

    def volumes(self, opts: DS3FSSpec, deployment: str, site: Site) -> list[Volume]:
        if site.local:
            return []
        return [Volume("kv", site.kv_dir, {"hostPath": {"path": opts.mount_path, "type": "Directory"}})]

    def external(self, opts: DS3FSSpec) -> str | None:
        return f"3FS mount {opts.mount_path}"
