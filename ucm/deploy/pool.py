"""An engine pool of the ``UCMDeployment`` resource (``spec.prefill``, ``spec.decode``) and its parts."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ucm.config import ConfigError
from ucm.deploy.schema import Arg, LabelValue, ResourceQuantity, Spec, cel, one_of
from ucm.environment import REFUSED as REFUSED_UCM_ENV
from ucm.environment import check_environment


class SecretKeySelector(Spec):
    name: str = Field(min_length=1, description="A Secret in the deployment's namespace")
    key: str = Field(min_length=1, description="The key of the Secret whose value the variable gets")


class EnvSource(Spec):
    secret_key_ref: SecretKeySelector = Field(description="A key of a Secret")


class EnvVar(Spec):
    """A literal ``value``, or ``valueFrom.secretKeyRef`` for secrets (an HF token): a literal would
    sit in the resource, and in the operator's last-handled annotation, for anyone who reads it."""

    model_config = Spec.model_config | cel(
        ("!(has(self.value) && has(self.valueFrom))", "env: give value or valueFrom, not both"),
    )
    name: str = Field(min_length=1, description="The variable's name")
    value: str | None = Field(None, description="Its literal value, readable by whoever can read the resource")
    value_from: EnvSource | None = Field(
        None, description="Its value from a Secret (Kubernetes only: for `ucm up` set it in your shell)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError("env: give value or valueFrom, not both")
        return self


class ObjectName(Spec):
    name: str = Field(min_length=1, description="In the deployment's namespace")


class EnvFromSource(Spec):
    """Every key of a Secret or ConfigMap as environment variables (Kubernetes' ``envFrom``); the
    variables the deployment sets itself take precedence. Locally (``ucm up``) they come from your
    shell instead."""

    model_config = Spec.model_config | cel(
        ("has(self.secretRef) != has(self.configMapRef)", "envFrom: set exactly one of secretRef, configMapRef"),
    )
    secret_ref: ObjectName | None = Field(None, description="A Secret whose keys become variables")
    config_map_ref: ObjectName | None = Field(None, description="A ConfigMap whose keys become variables")
    prefix: str = Field("", description="Prepended to every variable's name")

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvFromSource:
        one_of(self, ("secret_ref", "config_map_ref"), "envFrom")
        return self


class Resources(Spec):
    requests: dict[str, ResourceQuantity] = Field(
        default_factory=dict,
        description="The container's resource requests by resource name (cpu: 8, memory: 64Gi); nvidia.com/gpu "
        "comes from gpus",
    )
    limits: dict[str, ResourceQuantity] = Field(
        default_factory=dict,
        description="The container's resource limits by resource name (memory: 64Gi); nvidia.com/gpu comes from gpus",
    )
    gpus: int = Field(1, ge=0, description="nvidia.com/gpu per pod (requests = limits)")


class RolloutSpec(Spec):
    """How a pool's pods are replaced when its template changes (a new image, model or config): one
    new pod first, an old one removed only when the new one is ready — capacity never drops."""

    model_config = Spec.model_config | cel(
        ("self.maxSurge > 0 || self.maxUnavailable > 0", "rollout: maxSurge and maxUnavailable cannot both be 0"),
    )
    max_surge: int = Field(1, ge=0, le=1000, description="Pods above the replica count while rolling")
    max_unavailable: int = Field(0, ge=0, le=1000, description="Pods below the replica count while rolling")

    @model_validator(mode="after")
    def _progress(self) -> RolloutSpec:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError("rollout: maxSurge and maxUnavailable cannot both be 0 (the rollout could not progress)")
        return self


# What an autoscaled pool follows: (the engines' or the proxy's Prometheus series, default target).
SIGNALS: dict[str, tuple[str, float]] = {
    "waiting_requests": ("vllm:num_requests_waiting", 4.0),  # requests queued per engine
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", 0.8),  # fraction of the KV cache in use per engine
    "proxy_in_flight": ("ucm_proxy_backend_in_flight", 8.0),  # the proxy's requests per engine of the pool
}


class AutoscalingSpec(Spec):
    """An autoscaler (a KEDA ScaledObject or an HPA, as the operator is configured) owns the pool's
    replica count (``replicas`` is then ignored); the operator never writes it back."""

    model_config = Spec.model_config | cel(
        ("self.minReplicas <= self.maxReplicas", "autoscaling: minReplicas must not exceed maxReplicas"),
    )
    min_replicas: int = Field(1, ge=0, le=1000, description="0: scale to zero when idle (KEDA only)")
    max_replicas: int = Field(
        ge=1, le=1000, description="Most engines the autoscaler runs (with parallel.nodes > 1, groups of pods)"
    )
    signal: Literal["waiting_requests", "kv_cache_usage", "proxy_in_flight"] = Field(
        "waiting_requests",
        description="What the pool is sized by, per engine: waiting_requests (vllm:num_requests_waiting), "
        "kv_cache_usage (vllm:kv_cache_usage_perc) or proxy_in_flight (the proxy's requests to the pool, "
        "ucm_proxy_backend_in_flight)",
    )
    target: float | None = Field(
        None, gt=0, description="Per engine; default 4 waiting requests, 0.8 KV cache usage, 8 proxy requests"
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling: minReplicas must not exceed maxReplicas ({self.min_replicas} > {self.max_replicas})"
            )
        return self

    @property
    def metric(self) -> str:
        return SIGNALS[self.signal][0]

    @property
    def target_value(self) -> float:
        return self.target if self.target is not None else SIGNALS[self.signal][1]


# Long enough for a long generation (4k tokens at ~15 tokens/s) to finish during a rollout.
DRAIN_TIMEOUT_S = 300


class ParallelSpec(Spec):
    """How one engine of the pool is split: ``tensor`` x ``pipeline`` ranks (vLLM's
    --tensor-parallel-size, --pipeline-parallel-size) over ``nodes`` pods, each running an equal
    share of the ranks. More than one node makes each engine a group of pods started, restarted and
    rolled together (a LeaderWorkerSet: the leader serves, the workers run headless)."""

    model_config = Spec.model_config | cel(
        (
            "self.tensor * self.pipeline % self.nodes == 0",
            "parallel.nodes: must divide tensor x pipeline (each pod runs an equal share of the ranks)",
        ),
    )
    tensor: int = Field(1, ge=1, le=1024, description="Tensor-parallel ranks per engine")
    pipeline: int = Field(1, ge=1, le=256, description="Pipeline stages per engine")
    nodes: int = Field(1, ge=1, le=256, description="Pods per engine; above 1 the pool is a LeaderWorkerSet")
    topology_key: str | None = Field(
        None,
        min_length=1,
        description="A node label (topology.kubernetes.io/zone, a rack label) whose value the pods of one engine "
        "should share: a scheduling preference, since ranks exchange activations every layer",
    )

    @model_validator(mode="after")
    def _divides(self) -> ParallelSpec:
        if self.tensor * self.pipeline % self.nodes:
            raise ValueError(
                f"parallel.nodes: must divide tensor x pipeline (each pod runs an equal share of the ranks); "
                f"{self.tensor} x {self.pipeline} ranks over {self.nodes} nodes"
            )
        return self

    @property
    def ranks_per_node(self) -> int:
        return self.tensor * self.pipeline // self.nodes


class PoolSpec(Spec):
    model_config = Spec.model_config | cel(
        (
            "self.resources.gpus == 0 || self.resources.gpus * self.parallel.nodes == "
            "self.parallel.tensor * self.parallel.pipeline",
            "resources.gpus: one per rank a pod runs (tensor x pipeline / nodes), or 0 for CPU engines",
        ),
    )
    replicas: int = Field(1, ge=0, description="Engines (with parallel.nodes > 1, groups of pods)")
    resources: Resources = Field(
        Resources(), description="CPU, memory and GPUs of every pod of the pool (a multi-pod engine's workers too)"
    )
    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict, description="Node labels the pool's pods must run on (the pods' nodeSelector)"
    )
    tolerations: list[
        Annotated[dict[str, Any], Field(description="A Kubernetes toleration (key, operator, value, effect)")]
    ] = Field(default_factory=list, description="The pool's pods' tolerations, passed to the pods as given")
    affinity: dict[str, Any] | None = Field(
        None,
        description="The pool's pods' affinity (nodeAffinity, podAffinity, podAntiAffinity), passed to the pods as "
        "given; parallel.topologyKey adds a podAffinity preference",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        description="Environment variables of the pool's engines; VLLM_API_KEY, POD_IP and POD_NAME are the "
        "deployment's and refused",
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list, description="Secrets and ConfigMaps whose every key becomes a variable of the engines"
    )
    extra_args: list[Arg] = Field(
        default_factory=list, description="More `vllm serve` arguments for this pool's engines, after model.extraArgs"
    )
    rollout: RolloutSpec = RolloutSpec()
    autoscaling: AutoscalingSpec | None = None
    parallel: ParallelSpec = ParallelSpec()
    drain_timeout_s: int = Field(
        DRAIN_TIMEOUT_S,
        ge=0,
        le=3600,
        description="Seconds a stopping engine (rollout, scale-down, `ucm down`) keeps working on the requests it "
        "holds before they are cut (vLLM's --shutdown-timeout; 0 aborts them at once). New requests are refused "
        "meanwhile and the proxy retries them elsewhere. The pod's grace period follows.",
    )

    @model_validator(mode="after")
    def _ucm_variables(self) -> PoolSpec:
        """UCM's own variables (UCM_*) the engine would refuse at startup, in a crash loop. A Secret's
        value is unseen here: only names refused whatever their value are checked for those."""
        # "$(VAR)" is Kubernetes' own expansion of an earlier variable: known only in the pod.
        literal = {e.name: e.value for e in self.env if e.value is not None and "$(" not in e.value}
        secret = {e.name: "set" for e in self.env if e.value_from is not None and e.name in REFUSED_UCM_ENV}
        try:
            check_environment(literal | secret)
        except ConfigError as exc:
            raise ValueError(f"env: {exc}") from None
        return self

    @model_validator(mode="after")
    def _gpus_per_rank(self) -> PoolSpec:
        gpus, ranks = self.resources.gpus, self.parallel.ranks_per_node
        if gpus and gpus != ranks:
            raise ValueError(
                f"resources.gpus: one per rank a pod runs (tensor x pipeline / nodes = {ranks}), or 0 for CPU "
                f"engines; got {gpus}"
            )
        return self
