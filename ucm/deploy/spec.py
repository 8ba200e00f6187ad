"""The ``UCMDeployment`` resource (``ucm.io/v1alpha1``), defined once.

These models give defaults and validation (for the operator and ``ucm up`` alike) and generate the
CRD's ``openAPIV3Schema`` (:mod:`ucm.deploy.crd`). Cross-field rules are written twice, on purpose:
as CEL (``x-kubernetes-validations``, enforced by the API server) and as a Python validator right
beside it (enforced here, and the only way the rule is tested, since nothing here runs CEL).

Field names are camelCase, as in every Kubernetes API; Python code reads them snake_case.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from ucm import __version__
from ucm.hashing import HashAlgorithm
from ucm_proxy.config import Policy

GROUP = "ucm.io"
VERSION = "v1alpha1"
KIND = "UCMDeployment"
PLURAL = "ucmdeployments"

Quantity = int | str  # Kubernetes quantities: 8, "500m", "16Gi"


def cel(*rules: tuple[str, str]) -> ConfigDict:
    """Model config carrying CEL rules: (expression, message)."""
    return ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]},
    )


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


def _one_of(model: BaseModel, fields: tuple[str, ...], where: str) -> None:
    set_ = [f for f in fields if getattr(model, f) is not None]
    if len(set_) != 1:
        names = ", ".join(to_camel(f) for f in fields)
        raise ValueError(f"{where}: exactly one of {names} must be set, got {len(set_)}")


class PVCPath(Spec):
    claim_name: str = Field(min_length=1, description="PersistentVolumeClaim holding the model")
    path: str = Field("/", description="Directory of the model inside the claim")


class ModelSource(Spec):
    model_config = Spec.model_config | cel(
        (
            "[has(self.pvc), has(self.hostPath), has(self.hf)].filter(x, x).size() == 1",
            "model.source: exactly one of pvc, hostPath, hf must be set",
        ),
    )
    pvc: PVCPath | None = None
    host_path: str | None = Field(None, min_length=1, description="Model directory on every node")
    hf: str | None = Field(None, min_length=1, description="Hugging Face id, for nodes that can reach a hub")

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        _one_of(self, ("pvc", "host_path", "hf"), "model.source")
        return self


class ModelSpec(Spec):
    source: ModelSource
    served_name: str | None = Field(None, description="Name clients use; default: the source")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    max_model_len: int | None = Field(None, gt=0)
    block_size: int = Field(128, gt=0, description="Tokens per KV block (vLLM CPU needs a multiple of 32)")
    tensor_parallel_size: int = Field(1, ge=1)
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` arguments")


class ImageSpec(Spec):
    repository: str = Field("ucm/runtime", min_length=1)
    tag: str = Field(__version__, min_length=1, description="Default: this UCM release")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    pull_secrets: list[str] = Field(default_factory=list)


class EnvVar(Spec):
    name: str = Field(min_length=1)
    value: str = ""


class Resources(Spec):
    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)
    gpus: int = Field(1, ge=0, description="nvidia.com/gpu per pod (requests = limits)")


class PoolSpec(Spec):
    replicas: int = Field(1, ge=0)
    resources: Resources = Resources()
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    env: list[EnvVar] = Field(default_factory=list)
    extra_args: list[str] = Field(default_factory=list)


class NewClaim(Spec):
    storage_class_name: str | None = None
    size: Quantity = Field(description="e.g. 2Ti")
    access_modes: list[Literal["ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany", "ReadWriteOncePod"]] = Field(
        default_factory=lambda: ["ReadWriteMany"], min_length=1
    )


class ClaimSpec(Spec):
    model_config = Spec.model_config | cel(
        ("has(self.claimName) != has(self.create)", "store.pvc: set exactly one of claimName, create"),
    )
    claim_name: str | None = Field(None, min_length=1, description="An existing claim (RWX for several pods)")
    create: NewClaim | None = Field(None, description="A claim the operator creates and owns")

    @model_validator(mode="after")
    def _exactly_one(self) -> ClaimSpec:
        _one_of(self, ("claim_name", "create"), "store.pvc")
        return self


class NFSSpec(Spec):
    server: str = Field(min_length=1)
    path: str = Field(min_length=1)


class DS3FSSpec(Spec):
    mount_path: str = Field(min_length=1, description="Where the 3FS FUSE mount is on the nodes")


class MooncakeMaster(Spec):
    image: str | None = Field(None, description="Default: the runtime image (it ships mooncake_master)")
    port: int = Field(50051, ge=1, le=65535)
    metadata_port: int = Field(8080, ge=1, le=65535)


class MooncakeSpec(Spec):
    master: MooncakeMaster | None = Field(None, description="Run a master in the deployment")
    address: str | None = Field(None, description="An external master, host:port")
    metadata_server: str | None = Field(None, description="With address: its metadata URL")
    segment_size: Quantity = Field("4Gi", description="DRAM each vLLM pod adds to the pool")


class HashingSpec(Spec):
    algorithm: HashAlgorithm = "sha256"
    salt: str = ""


class StoreSpec(Spec):
    model_config = Spec.model_config | cel(
        ("self.type != 'posix' || has(self.pvc)", "store.pvc: required when type is posix"),
        ("self.type != 'nfs' || has(self.nfs)", "store.nfs: required when type is nfs"),
        ("self.type != 'ds3fs' || has(self.ds3fs)", "store.ds3fs: required when type is ds3fs"),
        ("self.type != 'mooncake' || has(self.mooncake)", "store.mooncake: required when type is mooncake"),
    )
    type: Literal["posix", "nfs", "ds3fs", "mooncake"]
    pvc: ClaimSpec | None = None
    nfs: NFSSpec | None = None
    ds3fs: DS3FSSpec | None = Field(None, alias="ds3fs")  # to_camel would say ds3Fs
    mooncake: MooncakeSpec | None = None
    cache_size: Quantity | None = Field(None, description="A DRAM tier in front of the store, per vLLM pod")
    hashing: HashingSpec = HashingSpec()

    @model_validator(mode="after")
    def _backend_options(self) -> StoreSpec:
        needed = {"posix": "pvc", "nfs": "nfs", "ds3fs": "ds3fs", "mooncake": "mooncake"}[self.type]
        if getattr(self, needed) is None:
            raise ValueError(f"store.{needed}: required when type is {self.type}")
        return self


class SecretKey(Spec):
    name: str = Field(min_length=1)
    key: str = Field("api-keys", min_length=1, description="One accepted key per line")


class ProxyService(Spec):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(8000, ge=1, le=65535)


class ProxyRouting(Spec):
    prefill: Policy = "prefix_affinity"
    decode: Policy = "least_outstanding"


class ProxySpec(Spec):
    image: str | None = Field(None, description="Default: ucm/proxy:<this UCM release>")
    replicas: int = Field(1, ge=0)
    routing: ProxyRouting = ProxyRouting()
    service: ProxyService = ProxyService()
    api_key_secret: SecretKey | None = None
    fallback_to_decode: bool = False


class UCMDeploymentSpec(Spec):
    model: ModelSpec
    image: ImageSpec = ImageSpec()
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec()
    store: StoreSpec
    proxy: ProxySpec = ProxySpec()


class Condition(Spec):
    type: Literal["Ready", "StoreReady", "PrefillReady", "DecodeReady", "ProxyReady", "Progressing", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    observed_generation: int | None = None
    last_transition_time: str | None = None


class ReadyReplicas(Spec):
    prefill: int = 0
    decode: int = 0
    proxy: int = 0


class UCMDeploymentStatus(Spec):
    conditions: list[Condition] = Field(default_factory=list)
    ready_replicas: ReadyReplicas = ReadyReplicas()
    endpoint: str | None = Field(None, description="The proxy's OpenAI base URL inside the cluster")
    observed_generation: int | None = None
