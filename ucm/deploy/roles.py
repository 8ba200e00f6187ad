"""What a plan is made of: roles (what runs, with which command, ports, probes and volumes), the
site it runs on, and the order roles start and stop in. Both executors read these: the Kubernetes
renderer (``ucm.deploy.kubernetes``) and the local one (``ucm.deploy.local``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ucm.deploy.pool import PoolSpec
from ucm.deploy.quantity import quantity_bytes as _quantity_bytes

Component = Literal["prefill", "decode", "proxy", "mooncake-master"]
ENGINES: tuple[Component, ...] = ("prefill", "decode")
# Roles start group by group, each when the previous one is ready: what the engines depend on (a
# store's own servers), the engines, then the proxy. They stop in the reverse order, so clients stop
# being routed before engines go, and engines go before their store.
START_ORDER: tuple[tuple[Component, ...], ...] = (("mooncake-master",), ENGINES, ("proxy",))
STORE_COMPONENTS: tuple[Component, ...] = START_ORDER[0]
# Keys the deployment generates once (random) and keeps in its own Secret ("<name>-credentials";
# locally, files in the run directory): created by the executors, never rendered with a value.
CREDENTIALS = "credentials"
BACKEND_KEY = "backend-api-key"  # engines require it (vLLM --api-key); only the proxy holds it
MAC_KEY = "kv-mac-key"  # engines sign and check file-store blocks with it (store.mac)
METRICS_TOKEN = "metrics-token"  # the proxy's /metrics and /pd-path require it (proxy.metricsAuth)


def credentials_secret(deployment: str) -> str:
    return f"{deployment}-{CREDENTIALS}"


class PlanError(ValueError):
    """The spec passed the schema but cannot work; the message starts with the field."""


def fail(where: str, what: str) -> PlanError:
    return PlanError(f"{where}: {what}")


def quantity_bytes(value: int | str, where: str) -> int:
    try:
        return _quantity_bytes(value, where)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


# A stopping role's time to exit beyond its drain (closing connections, stopping workers) before
# SIGKILL: the pod's grace period is drain delay + drain timeout + this; `ucm up` waits as long.
STOP_SLACK_S = 30


@dataclass(frozen=True)
class Port:
    name: str
    number: int


@dataclass(frozen=True)
class Probe:
    port: str
    path: str | None = None  # None: a TCP connect
    initial_delay_s: int = 0
    period_s: int = 5
    failure_threshold: int = 3


@dataclass(frozen=True)
class Volume:
    """A volume as Kubernetes knows it (``source`` is a volume source, e.g. ``{"nfs": {...}}``)."""

    name: str
    mount_path: str
    source: dict[str, Any]
    read_only: bool = False


@dataclass(frozen=True)
class SecretRef:
    secret: str  # a Secret's name in the deployment's namespace
    key: str


@dataclass(frozen=True)
class Step:
    """A command that runs to its end before the role's own, on every start of it, with the role's
    environment (a download). In Kubernetes an init container of each of the role's pods, with the
    role's image and volumes; locally run once, before the first role that has it starts."""

    name: str  # unique in the role
    command: list[str]
    writes: tuple[str, ...] = ()  # volumes (by name) it fills; the role itself mounts them read-only


@dataclass(frozen=True)
class Group:
    """An engine spread over ``size`` pods that start, restart and roll together (in Kubernetes a
    LeaderWorkerSet): the leader runs the role's command and serves; the others run
    ``worker_command``, which holds ranks only (vLLM --headless)."""

    size: int
    worker_command: list[str]
    topology_key: str | None = None  # a node label the group's pods should share


@dataclass(frozen=True)
class Role:
    name: str  # unique in the plan; Kubernetes objects are "<deployment>-<name>"
    component: Component
    command: list[str]
    ports: list[Port]
    replicas: int = 1
    env: dict[str, str] = field(default_factory=dict)
    secret_env: dict[str, SecretRef] = field(default_factory=dict)  # env vars from Secrets
    files: list[str] = field(default_factory=list)  # plan files the role reads (their change restarts it)
    volumes: list[Volume] = field(default_factory=list)
    readiness: Probe | None = None
    liveness: Probe | None = None
    startup: Probe | None = None
    pool: PoolSpec | None = None  # scheduling and resources (Kubernetes); engines only
    image: str | None = None  # None: the deployment's runtime image
    drain_delay_s: int = 0  # serving on after leaving the Service's endpoints (preStop)
    drain_timeout_s: int = 0  # then, after SIGTERM, finishing the requests it holds
    group: Group | None = None  # engines of more than one pod
    steps: list[Step] = field(default_factory=list)  # run to their end before the command


@dataclass(frozen=True)
class Plan:
    name: str
    roles: list[Role]
    files: dict[str, str]  # config files by name: a ConfigMap in Kubernetes, a directory locally
    store_claim: dict[str, Any] | None = None  # a PVC spec the deployment owns, when asked for
    store_claim_retained: bool = False  # that claim outlives the deployment (store.pvc.create.whenDeleted)
    store_external: str | None = None  # the store nothing here runs or claims, described for status
    credentials: tuple[str, ...] = ()  # keys of the deployment's generated credentials

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    def start_groups(self) -> list[list[Role]]:
        """Roles by start group (see ``START_ORDER``); stop them in the reverse order."""
        return [[r for r in self.roles if r.component in group] for group in START_ORDER]


@dataclass(frozen=True)
class Site:
    """Where a plan runs.

    ``kubernetes``: pods behind Services; fixed container ports; roles reach each other by Service
    name; files and volumes are mounted. ``local``: processes on loopback, each replica its own free
    port (``ports`` hands them out); paths are this machine's."""

    kind: Literal["kubernetes", "local"]
    namespace: str = "default"
    config_dir: str = "/etc/ucm"
    kv_dir: str = "/var/lib/ucm/kv"  # where file stores keep blocks: a mount in pods, a directory locally
    adapters_dir: str = "/adapters"  # LoRA adapters: mounts below it in pods; locally, hub downloads
    ports: Callable[[str], int] | None = None  # local: the port for a role (or "role/port-name")
    # local: whether this machine's CPU has bfloat16 arithmetic (ucm.cpu); without it a model's
    # dtype "auto" runs float32 (vLLM would pick bfloat16 and run ~100x slower)
    native_bfloat16: bool = True

    @property
    def local(self) -> bool:
        return self.kind == "local"

    @property
    def bind(self) -> str:
        return "127.0.0.1" if self.local else "0.0.0.0"

    def port(self, role: str, default: int) -> int:
        if self.ports is None or not self.local:
            return default
        return self.ports(role)

    def host(self, deployment: str, role: str) -> str:
        return "127.0.0.1" if self.local else f"{deployment}-{role}"

    @property
    def credentials_dir(self) -> str:
        """Where a role reads the generated credentials as files (a Secret volume in pods)."""
        return f"{self.config_dir}/{CREDENTIALS}" if self.local else f"/etc/ucm-{CREDENTIALS}"
