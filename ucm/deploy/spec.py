"""The ``UCMDeployment`` resource (``ucm.io/v1alpha1``), defined once.

These models give defaults and validation (for the operator, ``ucm up`` and ``ucm render`` alike)
and generate the CRD's ``openAPIV3Schema`` (:mod:`ucm.deploy.crd`). Field names are camelCase, as in
every Kubernetes API; Python code reads them snake_case. The engine pools' models come from
:mod:`ucm.deploy.pool` (the plan's roles carry them, and the store kinds build roles); each store
kind's options from its module in :mod:`ucm.deploy.stores`; the proxy's own options are the proxy's
(``proxy.config``); the LoRA adapters' from :mod:`ucm.deploy.lora`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, create_model, model_validator
from pydantic.alias_generators import to_camel

from ucm import __version__
from ucm.deploy.lora import LoraSpec
from ucm.deploy.pool import PoolSpec
from ucm.deploy.schema import Arg, LabelValue, Quantity, Spec, camel, cel, deprecated_spellings, one_of
from ucm.deploy.stores import KINDS, StoreKind
from ucm.hashing import HashAlgorithm
from ucm.integration.vllm.config import BlendConfig
from ucm.sparse.config import OPTIONS, SparseConfig

GROUP = "ucm.io"
VERSION = "v1alpha1"
KIND = "UCMDeployment"
PLURAL = "ucmdeployments"


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
    pvc: PVCPath | None = Field(
        None,
        description="A PersistentVolumeClaim holding the model, mounted read-only at /models in every engine pod "
        "(Kubernetes only: `ucm up` refuses it)",
    )
    host_path: str | None = Field(None, min_length=1, description="Model directory on every node")
    hf: str | None = Field(None, min_length=1, description="Hugging Face id, for nodes that can reach a hub")

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        one_of(self, ("pvc", "host_path", "hf"), "model.source")
        return self

    @property
    def id(self) -> str:
        """The source as one string, the same on every pod whatever path it is mounted at."""
        if self.hf is not None:
            return self.hf
        if self.host_path is not None:
            return self.host_path
        assert self.pvc is not None
        return f"pvc:{self.pvc.claim_name}/{self.pvc.path.strip('/')}"


class ModelSpec(Spec):
    source: ModelSource = Field(description="Where every engine loads the model from: exactly one of pvc, hostPath, hf")
    served_name: str | None = Field(None, description="Name clients use; default: the source")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto",
        description="Weights' and activations' dtype (vLLM --dtype); auto: vLLM's choice (on CPUs bfloat16, "
        "float32 weights included; `ucm up` runs float32 on a CPU without bfloat16 arithmetic, AVX512-BF16 or "
        "AMX, where bfloat16 runs ~100x slower)",
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Longest request, prompt plus output, in tokens (vLLM --max-model-len); unset: the model's "
        "context length",
    )
    block_size: int = Field(128, gt=0, description="Tokens per KV block (vLLM CPU needs a multiple of 32)")
    extra_args: list[Arg] = Field(
        default_factory=list, description="More `vllm serve` arguments, for both pools' engines"
    )

    @property
    def served(self) -> str:
        """The name clients use for the base model."""
        return self.served_name or self.source.id


class ImageSpec(Spec):
    repository: str = Field(
        "ucm/runtime", min_length=1, description="The runtime image's registry and repository, without the tag"
    )
    tag: str | None = Field(
        None,
        min_length=1,
        description="Default: the operator's own UCM release, <release> for pods with GPUs and the CPU flavour "
        "<release>-cpu for pods without, so that engines move with the operator on an upgrade (the operator "
        "renders their commands); set it to pin them",
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="imagePullPolicy of every container of the deployment, the proxy's included"
    )
    pull_secrets: list[Annotated[str, Field(description="A Secret's name")]] = Field(
        default_factory=list,
        description="Secrets in the deployment's namespace that every pod pulls its image with (imagePullSecrets)",
    )

    def reference(self, cpu: bool) -> str:
        """A pod's runtime image; without a tag, the rendering UCM release's, in the CPU flavour for
        pods without GPUs (``make images`` builds both)."""
        return f"{self.repository}:{self.tag or (f'{__version__}-cpu' if cpu else __version__)}"


class HashingSpec(Spec):
    """How block ids are computed. Engines find a block only under the id they compute themselves, so
    changing either field leaves the blocks already stored unused."""

    algorithm: HashAlgorithm = Field("sha256", description="The hash function of block ids: sha256, blake3 or md5")
    salt: str = Field(
        "",
        description="Hashed into every block id: deployments sharing a store under different salts share no "
        "blocks (a request's cache_salt is hashed beside it)",
    )


FILE_KINDS = tuple(k.name for k in KINDS.values() if k.signs_blocks)  # block files; they can carry a MAC


class FileStoreSpec(Spec):
    """How engines use a file store (posix, nfs, ds3fs): what a platform team tunes per volume."""

    capacity: Quantity | None = Field(
        None,
        description="Least-recently-used blocks are evicted above this (every engine checks; one evicts at a "
        "time). Default: 90% of store.pvc.create.size when the deployment creates the claim; otherwise none, "
        "since the volume's size is unknown (then `ucm store gc` frees space)",
    )
    evict_to: float = Field(0.9, gt=0, lt=1, description="Fraction of capacity left after an eviction pass")
    io_threads: int = Field(8, ge=1, le=256, description="Parallel block reads and writes per engine process")
    direct_io: bool = Field(
        False, alias="directIO", description="Bypass the page cache (O_DIRECT); for fast local NVMe or 3FS"
    )
    fsync: bool | None = Field(
        None, description="fsync every block and its directory (survives power loss). Default: true for nfs only"
    )
    verify_checksum: bool = Field(
        True, description="Hash every loaded block; false trusts storage that checksums end to end (not with mac)"
    )


class ConnectorSpec(Spec):
    """The connector's timing and transfer modes, the same on every engine."""

    load_mode: Literal["layer", "step"] = Field(
        "layer", description="layer: copy loaded blocks into each layer just before it runs; step: all up front"
    )
    save_mode: Literal["layer", "step"] = Field(
        "layer", description="layer: save each layer's new blocks as it finishes; step: all at the step's end"
    )
    pd_wait_timeout_s: float = Field(
        30.0, ge=0, le=600, description="Decode waits this long for blocks prefill promised, then recomputes them"
    )
    pd_save_wait_s: float = Field(
        10.0, ge=0, le=600, description="Prefill answers once its blocks are in the store, waiting up to this long"
    )
    huge_pages: bool = Field(
        True,
        description="CPU engines keep their KV cache on transparent 2 MiB pages, which a node's transparent_hugepage "
        "mode 'madvise' grants only when asked: fewer TLB misses where decode reads scattered blocks (sparse "
        "attention). No effect on GPU engines, on nodes whose mode is 'never', or in engine processes with huge pages "
        "disabled (PR_SET_THP_DISABLE)",
    )


class _StoreSpec(Spec):
    """Fields shared by every store kind; ``StoreSpec`` adds ``type`` and one options field per kind."""

    model_config = Spec.model_config | cel(
        *(
            (f"self.type != '{k.name}' || has(self.{k.field})", f"store.{k.field}: required when type is {k.name}")
            for k in KINDS.values()
        ),
        (
            "!self.mac || self.type in [" + ", ".join(f"'{k}'" for k in FILE_KINDS) + "]",
            f"store.mac: only file stores ({', '.join(FILE_KINDS)}) sign blocks",
        ),
        (
            "!has(self.files) || self.type in [" + ", ".join(f"'{k}'" for k in FILE_KINDS) + "]",
            f"store.files: only for file stores ({', '.join(FILE_KINDS)})",
        ),
        (
            "!has(self.files) || !self.mac || !has(self.files.verifyChecksum) || self.files.verifyChecksum",
            "store.files.verifyChecksum: signed blocks (store.mac) are always verified",
        ),
    )

    mac: bool = Field(
        False,
        description="Sign every block with a key the deployment generates (a keyed BLAKE3 in the block's "
        "trailer, kept in the <name>-credentials Secret): whoever can write the shared volume but lacks the key "
        "cannot plant KV that engines load. File stores (posix, nfs, ds3fs); loads cost more (store_bench).",
    )

    @property
    def kind(self) -> StoreKind:
        return KINDS[self.type]  # type: ignore[attr-defined]

    @property
    def options(self) -> Any:
        return getattr(self, self.kind.field)

    @model_validator(mode="after")
    def _kind_options(self) -> _StoreSpec:
        if self.options is None:
            raise ValueError(f"store.{self.kind.field}: required when type is {self.kind.name}")
        if self.mac and not self.kind.signs_blocks:
            raise ValueError(f"store.mac: only file stores ({', '.join(FILE_KINDS)}) sign blocks, not {self.type}")
        files = self.files  # type: ignore[attr-defined]
        if files is not None and self.type not in FILE_KINDS:
            raise ValueError(f"store.files: only for file stores ({', '.join(FILE_KINDS)}), not {self.type}")
        if files is not None and self.mac and not files.verify_checksum:
            raise ValueError("store.files.verifyChecksum: signed blocks (store.mac) are always verified")
        return self


StoreSpec = create_model(
    "StoreSpec",
    __base__=_StoreSpec,
    type=(Literal[tuple(KINDS)], Field(description="The kind of shared store: " + ", ".join(KINDS))),
    **{k.field: (k.options | None, Field(None, alias=k.field, description=k.description)) for k in KINDS.values()},
    cache_size=(
        Quantity | None,
        Field(
            None,
            description="A DRAM tier in front of the store, this size in every rank's process: a pod running "
            "tensor x pipeline / nodes ranks holds that many",
        ),
    ),
    files=(FileStoreSpec | None, Field(None, description="Capacity and I/O of a file store (posix, nfs, ds3fs)")),
    hashing=(HashingSpec, HashingSpec()),  # described by its docstring
)


class SecretKey(Spec):
    name: str = Field(min_length=1, description="A Secret in the deployment's namespace")
    key: str = Field("api-keys", min_length=1, description="One accepted key per line")


class ProxyService(Spec):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP",
        description="The Service's type; NodePort and LoadBalancer need apiKeySecret (or allowAnonymous)",
    )
    port: int = Field(8000, ge=1, le=65535, description="The Service's port, the one status.endpoint names")


class ProxySpec(Spec):
    image: str | None = Field(None, description="Default: ucm/proxy:<this UCM release>")
    replicas: int = Field(1, ge=0, description="Proxy pods (`ucm up` runs one)")
    service: ProxyService = Field(ProxyService(), description="The proxy's Service, <name>-proxy")
    api_key_secret: SecretKey | None = Field(
        None,
        description="The API keys clients must send (Authorization: Bearer <key>), one per line in a Secret's key; "
        "re-read when the Secret changes. Unset: no key is asked for",
    )
    allow_anonymous: bool = Field(
        False,
        description="Serve a NodePort or LoadBalancer proxy without apiKeySecret (anyone who reaches it may use it)",
    )
    metrics_auth: bool = Field(
        False,
        description="The proxy's /metrics and /pd-path require a bearer token the deployment generates (key "
        "metrics-token of its <name>-credentials Secret); the ServiceMonitor the operator renders carries it",
    )
    kv_events: bool = Field(
        True,
        description="Prefill engines publish their KV cache events (vLLM --kv-events-config) to the proxy, which "
        "routes each prompt to the engine that holds most of its prefix (routing policy kv_aware); false: the "
        "proxy's prefix_affinity hashing, blind to what engines hold",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="ucm-proxy's own options as in its config file, snake_case names included: the file's "
        "content, passed through (routing, timeouts, health, retries, fallback_to_decode, ...); validated by the "
        "proxy. Backends, discovery, host, port and API keys come from the deployment.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


def _absent(name: str) -> str:
    """CEL: the field is given under neither its name nor its deprecated one."""
    if to_camel(name) == name:
        return f"!has(self.{name})"
    return f"(!has(self.{to_camel(name)}) && !has(self.{name}))"


class _Sparse(SparseConfig):
    """Sparse attention for the engines that decode (prefill stays dense): ``ucm.sparse``'s settings
    (UCM's parameters, ``sparse_ratio`` written ``sparseRatio`` here)."""

    model_config = SparseConfig.model_config | cel(
        *(
            (f"{_absent(name)} || self.algorithm == '{name}'", f"sparse.{to_camel(name)}: options of another algorithm")
            for name in OPTIONS
        )
    )


class _Blend(BlendConfig):
    """Blend for the engines that prefill: a prompt's chunks (between separators) reuse their cached KV
    wherever they appear, a share of their tokens recomputed (by default those the question attends to
    most). A chunk is cached when prefilled alone or as a prompt's start. Engines run UCM's Blend model
    class (Llama-shaped models)."""


SparseSpec = camel(_Sparse, "SparseSpec")
BlendSpec = camel(_Blend, "BlendSpec")


class Scraper(Spec):
    """Pods that may scrape the engines' and the proxy's ``/metrics`` (a Prometheus), as a
    NetworkPolicy peer: pods matching ``podSelector`` in namespaces matching ``namespaceSelector``."""

    model_config = Spec.model_config | cel(
        (
            "has(self.namespaceSelector) || has(self.podSelector)",
            "scrapers: set namespaceSelector, podSelector or both",
        ),
    )
    namespace_selector: dict[str, LabelValue] | None = Field(None, description="Namespace labels (matchLabels)")
    pod_selector: dict[str, LabelValue] | None = Field(None, description="Pod labels (matchLabels)")

    @model_validator(mode="after")
    def _some(self) -> Scraper:
        if self.namespace_selector is None and self.pod_selector is None:
            raise ValueError("scrapers: set namespaceSelector, podSelector or both (an empty peer would admit anyone)")
        return self


class MonitoringSpec(Spec):
    """Who may read the engines' metrics; otherwise the engines accept only the deployment's proxy and
    each other (NetworkPolicy)."""

    scrapers: list[Scraper] = Field(
        default_factory=list,
        description="Admitted to the engines' API port, where vLLM serves /metrics (its /v1 routes still need the "
        "deployment's key); nothing else in the cluster reaches the engines",
    )


SPLIT_RULE = (
    "decode.parallel: tensor and pipeline equal prefill's, or only tensor differs, with pipeline 1 and the larger "
    "tensor a multiple of the smaller (the store then keeps each block in shares of the larger)"
)


class UCMDeploymentSpec(Spec):
    """A disaggregated vLLM deployment: a prefill and a decode pool of engines sharing a KV store, behind
    a proxy that sends each request through them."""

    model_config = Spec.model_config | cel(
        (
            "(self.prefill.parallel.tensor == self.decode.parallel.tensor && "
            "self.prefill.parallel.pipeline == self.decode.parallel.pipeline) || "
            "(self.prefill.parallel.pipeline == 1 && self.decode.parallel.pipeline == 1 && "
            "(self.prefill.parallel.tensor % self.decode.parallel.tensor == 0 || "
            "self.decode.parallel.tensor % self.prefill.parallel.tensor == 0))",
            SPLIT_RULE,
        ),
    )
    model: ModelSpec = Field(description="The model both pools serve, and how vLLM runs it")
    image: ImageSpec = Field(
        ImageSpec(),
        description="The runtime image of the engines (and of a Mooncake master without its own); the proxy's is "
        "proxy.image. Kubernetes only",
    )
    prefill: PoolSpec = Field(
        PoolSpec(), description="The prefill pool: engines that compute prompts' KV and save it to the store"
    )
    decode: PoolSpec = Field(
        PoolSpec(),
        description="The decode pool: engines that load prompts' KV from the store and generate; its replicas are "
        "the scale subresource's",
    )
    store: StoreSpec = Field(  # type: ignore[valid-type]
        description="The KV store both pools share: type names the kind, the field of that kind its options"
    )
    connector: ConnectorSpec = ConnectorSpec()
    proxy: ProxySpec = Field(
        ProxySpec(),
        description="The proxy clients call (status.endpoint): an OpenAI-compatible API over the pools",
    )
    sparse: SparseSpec | None = Field(None, description="Sparse attention for long decodes (decode engines)")
    blend: BlendSpec | None = Field(
        None, description="Reuse retrieved chunks' KV wherever a prompt places them (prefill engines)"
    )
    monitoring: MonitoringSpec = MonitoringSpec()  # described by its docstring
    lora: LoraSpec | None = None  # described by its docstring

    @model_validator(mode="after")
    def _adapters_named_apart(self) -> UCMDeploymentSpec:
        for i, adapter in enumerate(self.lora.adapters if self.lora is not None else ()):
            if adapter.name == self.model.served:
                raise ValueError(
                    f"lora.adapters[{i}].name: {adapter.name} is the base model's served name (model.servedName, "
                    "or its source); a request naming it would never reach the adapter"
                )
        return self

    @model_validator(mode="after")
    def _blend_on_one_rank(self) -> UCMDeploymentSpec:
        p = self.prefill.parallel
        if self.blend is not None and p.tensor * p.pipeline > 1:
            raise ValueError(
                f"blend: engines split over ranks (tensor and pipeline {p.tensor} x {p.pipeline}) cannot blend "
                "yet; run prefill with both at 1 or leave blend out"
            )
        return self

    @model_validator(mode="after")
    def _offload_on_one_stage(self) -> UCMDeploymentSpec:
        d = self.decode.parallel
        if self.sparse is not None and self.sparse.offload_blocks and d.pipeline > 1:
            raise ValueError(
                f"sparse.offloadBlocks: decode engines split into pipeline stages ({d.pipeline}) cannot "
                "off-load yet; run decode with parallel.pipeline 1 (tensor may be any) or leave offloadBlocks out"
            )
        return self

    @model_validator(mode="after")
    def _same_split(self) -> UCMDeploymentSpec:
        p, d = self.prefill.parallel, self.decode.parallel
        if p.tensor == d.tensor and p.pipeline == d.pipeline:
            return self
        small, large = sorted((p.tensor, d.tensor))
        if p.pipeline != d.pipeline or p.pipeline > 1 or large % small:
            raise ValueError(f"{SPLIT_RULE}; got prefill {p.tensor} x {p.pipeline}, decode {d.tensor} x {d.pipeline}")
        if self.blend is not None:
            raise ValueError("blend: needs prefill and decode split alike (the same parallel.tensor)")
        return self

    @property
    def store_tp(self) -> int | None:
        """The shares a block is kept in, in the store, when the pools' TP differ: the larger."""
        p, d = self.prefill.parallel.tensor, self.decode.parallel.tensor
        return None if p == d else max(p, d)


class Condition(Spec):
    """One aspect of the deployment's state, as in every Kubernetes resource's conditions."""

    type: Literal[
        "Ready",
        "StoreReady",
        "PrefillReady",
        "DecodeReady",
        "ProxyReady",
        "PDPathHealthy",
        "DisaggregationEffective",
        "Progressing",
        "Degraded",
        "Contested",
    ] = Field(
        description="Ready: every role and the store ready, the last apply succeeded; StoreReady, PrefillReady, "
        "DecodeReady, ProxyReady: that role; PDPathHealthy: the proxy's last check through prefill, store and "
        "decode passed; DisaggregationEffective: recent requests went through prefill and decode loaded its KV; "
        "Progressing: roles not all ready yet, nothing failed; Degraded: the spec is invalid or refused, or an apply "
        "failed; Contested: children changed outside the resource again and again, put back with backoff"
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False, or Unknown (not known yet)")
    reason: str = Field("", description="Why, in one CamelCase word (Waiting, InvalidSpec, NotChecked, ...)")
    message: str = Field("", description="Details, for people")
    observed_generation: int | None = Field(None, description="The metadata.generation the condition reflects")
    last_transition_time: str | None = Field(None, description="When status last changed (RFC 3339, UTC)")


class ReadyReplicas(Spec):
    """Ready replicas per role, as their workloads count them."""

    prefill: int = Field(0, description="Ready prefill engines (a multi-pod engine counts once all its pods are)")
    decode: int = Field(0, description="Ready decode engines (a multi-pod engine counts once all its pods are)")
    proxy: int = Field(0, description="Ready proxy pods")


class PDPathStatus(Spec):
    """Written by the proxy (``ucm_proxy.pdpath``), read by the operator into conditions."""

    healthy: bool = Field(description="The check passed: a prefill saved blocks to the store and a decode loaded them")
    reason: str = Field(
        description="Healthy, ScaledToZero (a pool has no pod: nothing to check), or the broken hop: NoPrefill, "
        "PrefillFailed, DecodeNotLoading, ..."
    )
    message: str = Field("", description="What the check found: the backends and blocks, or what failed")
    checked_at: str | None = Field(None, description="When the check ran (RFC 3339, UTC)")
    effective: bool | None = Field(None, description="Most recent requests went through prefill and reused its KV")
    effective_reason: str = Field(
        "",
        description="Why effective is what it is: Disaggregated, NotDisaggregated, DecodeRecomputing, NoTraffic, ...",
    )
    effective_message: str = Field(
        "", description="How many recent requests went through prefill, and how many PD answers loaded the KV"
    )
    reporter: str = Field("", description="The proxy pod that checked")


class UCMDeploymentStatus(Spec):
    """What the operator observed (the proxy writes pdPath)."""

    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, StoreReady, PrefillReady, DecodeReady, ProxyReady, PDPathHealthy, "
        "DisaggregationEffective, Progressing and Degraded",
    )
    ready_replicas: ReadyReplicas = ReadyReplicas()  # described by its docstring
    endpoint: str | None = Field(None, description="The proxy's OpenAI base URL inside the cluster")
    observed_generation: int | None = Field(
        None,
        description="The metadata.generation this status reflects; behind it, the latest change is not handled yet",
    )
    decode_selector: str = Field(
        "",
        description="The serving decode pods' label selector (a multi-pod engine's leaders): the scale "
        "subresource's, for an HorizontalPodAutoscaler",
    )
    pd_path: PDPathStatus | None = Field(None, description="The proxy's last check through prefill, store and decode")


def read_spec(spec: Mapping[str, Any]) -> UCMDeploymentSpec:
    """A resource's ``spec``, validated as the API server reads it: fields by their names in the resource
    only (``apiKeySecret``, not ``api_key_secret``, which the CRD does not know) or a deprecated twin.
    (Python code builds models by field name; users write resources.)"""
    return UCMDeploymentSpec.model_validate(spec, by_name=False)


def deprecated_fields(spec: Mapping[str, Any]) -> list[str]:
    """Where a resource's ``spec`` uses a field's old (snake_case) spelling, one message each: still
    accepted, reported as a warning (``ucm render``/``ucm up`` on standard error, the operator as an Event)."""
    return deprecated_spellings(UCMDeploymentSpec, spec, "spec")
