"""``type: posix``: a file per block on a volume every engine mounts (a ReadWriteMany claim)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ucm.deploy.roles import Site, Volume, quantity_bytes
from ucm.deploy.schema import Quantity, Spec, cel, one_of
from ucm.deploy.stores.base import StoreKind


class NewClaim(Spec):
    storage_class_name: str | None = Field(
        None, description="The claim's StorageClass; unset (or empty): the cluster's default StorageClass"
    )
    size: Quantity = Field(description="e.g. 2Ti")
    access_modes: list[
        Annotated[
            Literal["ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany", "ReadWriteOncePod"],
            Field(description="A PersistentVolumeClaim access mode"),
        ]
    ] = Field(
        default_factory=lambda: ["ReadWriteMany"],
        min_length=1,
        description="The claim's access modes; every engine pod mounts it read-write, hence ReadWriteMany by default",
    )
    when_deleted: Literal["Delete", "Retain"] = Field(
        "Delete",
        description="What deleting the UCMDeployment does to the claim and the KV blocks on it (as a StatefulSet's "
        "persistentVolumeClaimRetentionPolicy): Delete, with the deployment; Retain, kept (it carries no owner "
        "reference, so no cascade deletes it either), and a UCMDeployment of the same name in the namespace uses it "
        "again. `kubectl delete pvc NAME-kv` frees it",
    )


class ClaimSpec(Spec):
    model_config = Spec.model_config | cel(
        ("has(self.claimName) != has(self.create)", "store.pvc: set exactly one of claimName, create"),
    )
    claim_name: str | None = Field(None, min_length=1, description="An existing claim (RWX for several pods)")
    create: NewClaim | None = Field(
        None, description="A claim the operator creates (claimName: one you bring, which is never deleted)"
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ClaimSpec:
        one_of(self, ("claim_name", "create"), "store.pvc")
        return self


class Posix(StoreKind):
    name = "posix"
    field = "pvc"
    options = ClaimSpec
    description = "The PersistentVolumeClaim holding the blocks (type posix)"
    signs_blocks = True

    def connector(self, opts: ClaimSpec, deployment: str, site: Site) -> dict[str, Any]:
        return {"posix": {"roots": [site.kv_dir]}}

    def volumes(self, opts: ClaimSpec, deployment: str, site: Site) -> list[Volume]:
        if site.local:
            return []
        claim = opts.claim_name or f"{deployment}-kv"
        return [Volume("kv", site.kv_dir, {"persistentVolumeClaim": {"claimName": claim}})]

    def claim(self, opts: ClaimSpec, site: Site) -> dict[str, Any] | None:
        if site.local or opts.create is None:
            return None
        new = opts.create
        quantity_bytes(new.size, "store.pvc.create.size")
        claim: dict[str, Any] = {
            "accessModes": list(new.access_modes),
            "resources": {"requests": {"storage": str(new.size)}},
        }
        if new.storage_class_name:
            claim["storageClassName"] = new.storage_class_name
        return claim

    def retained(self, opts: ClaimSpec) -> bool:
        return opts.create is not None and opts.create.when_deleted == "Retain"

    def known_size(self, opts: ClaimSpec) -> int | None:
        return quantity_bytes(opts.create.size, "store.pvc.create.size") if opts.create is not None else None

    def external(self, opts: ClaimSpec) -> str | None:
        return f"claim {opts.claim_name}" if opts.claim_name else None

    def kubernetes_only(self, opts: ClaimSpec) -> list[str]:
        return ["store.pvc (blocks go to the run directory)"]
