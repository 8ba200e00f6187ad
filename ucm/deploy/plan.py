"""A ``UCMDeployment`` spec as a plain plan of roles: what runs, with which command, ports, probes,
volumes and config files.

Two executors read the same plan: the operator renders it into Kubernetes objects
(``ucm_operator.render``), ``ucm up`` runs it as local processes (``ucm.deploy.local``). What differs
between them is only *where* things are — ports, addresses, paths — and that is the :class:`Site`.

Every flag and config format here comes from the component that owns it: the connector's
``kv_transfer_config``, the proxy's ``ProxyConfig``. A spec that the CRD accepts but that cannot work
raises :class:`PlanError` naming the field (the operator reports it as ``Degraded/InvalidSpec``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from ucm import __version__
from ucm.config import ConfigError, format_validation_error
from ucm.deploy.quantity import quantity_bytes as _quantity_bytes
from ucm.deploy.spec import PoolSpec, UCMDeploymentSpec
from ucm.integration.vllm.config import kv_transfer_config
from ucm_proxy.config import ProxyConfig

PROXY_IMAGE = "ucm/proxy"  # runtime/Dockerfile.proxy; `make images` tags it with the release
KV_CONFIG_FILE = "kv-transfer-config.json"
PROXY_CONFIG_FILE = "proxy.yaml"
API_KEYS_DIR = "/etc/ucm/api-keys"
MODEL_MOUNT = "/models"
KV_MOUNT = "/var/lib/ucm/kv"
VLLM_PORT = 8000
PROXY_PORT = 8000
MOONCAKE_METRICS_PORT = 9003
# Seconds a stopping pod keeps serving after it leaves its Service's endpoints: the proxy's
# EndpointSlice watch sees it go first, so no new request is routed to a dying engine.
DRAIN_DELAY_S = 10

Component = Literal["prefill", "decode", "proxy", "mooncake-master"]


class PlanError(ValueError):
    """The spec passed the schema but cannot work; the message starts with the field."""


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
class Role:
    name: str  # unique in the plan; Kubernetes objects are "<deployment>-<name>"
    component: Component
    command: list[str]
    ports: list[Port]
    replicas: int = 1
    env: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # plan files the role reads (their change restarts it)
    volumes: list[Volume] = field(default_factory=list)
    readiness: Probe | None = None
    liveness: Probe | None = None
    startup: Probe | None = None
    pool: PoolSpec | None = None  # scheduling and resources (Kubernetes); engines only
    image: str | None = None  # None: the deployment's runtime image
    drain_delay_s: int = 0


@dataclass(frozen=True)
class Plan:
    name: str
    roles: list[Role]
    files: dict[str, str]  # config files by name: a ConfigMap in Kubernetes, a directory locally
    store_claim: dict[str, Any] | None = None  # a PVC spec the deployment owns, when asked for

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)


@dataclass(frozen=True)
class Site:
    """Where a plan runs.

    ``kubernetes``: pods behind Services; fixed container ports; roles reach each other by Service
    name; files and volumes are mounted. ``local``: processes on loopback, each replica its own free
    port (``ports`` hands them out); paths are this machine's."""

    kind: Literal["kubernetes", "local"]
    namespace: str = "default"
    config_dir: str = "/etc/ucm"
    kv_dir: str = KV_MOUNT  # local: the posix store's directory
    ports: Callable[[str], int] | None = None  # local: the port for a role (or "role/port-name")

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


def build_plan(name: str, spec: UCMDeploymentSpec, site: Site) -> Plan:
    """The roles of one deployment. Raises :class:`PlanError` for a spec that cannot work."""
    roles: list[Role] = []
    files: dict[str, str] = {}
    store, master = _store(name, spec, site)
    if master is not None:
        roles.append(master)
    model_path, model_volumes = _model(spec, site)
    files[KV_CONFIG_FILE] = json.dumps(_kv_config(spec, store), indent=2, sort_keys=True) + "\n"
    engines: dict[str, list[str]] = {}
    for component, pool in (("prefill", spec.prefill), ("decode", spec.decode)):
        instances = (
            [(f"{component}-{i}", 1) for i in range(pool.replicas)] if site.local else [(component, pool.replicas)]
        )
        for role_name, replicas in instances:
            port = site.port(role_name, VLLM_PORT)
            roles.append(
                _engine(name, role_name, component, replicas, port, pool, spec, site, model_path, model_volumes)
            )
            engines.setdefault(component, []).append(f"http://{site.host(name, role_name)}:{port}")
    proxy_port = site.port("proxy", PROXY_PORT)
    files[PROXY_CONFIG_FILE] = _proxy_config(name, spec, site, proxy_port, engines)
    roles.append(_proxy(spec, site, proxy_port))
    return Plan(name=name, roles=roles, files=files, store_claim=_claim(spec, site))


def quantity_bytes(value: int | str, where: str) -> int:
    try:
        return _quantity_bytes(value, where)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def _fail(where: str, what: str) -> PlanError:
    return PlanError(f"{where}: {what}")


def _model(spec: UCMDeploymentSpec, site: Site) -> tuple[str, list[Volume]]:
    source = spec.model.source
    if source.hf is not None:
        return source.hf, []
    if source.host_path is not None:
        if site.local:
            return source.host_path, []
        volume = Volume("model", source.host_path, {"hostPath": {"path": source.host_path, "type": "Directory"}}, True)
        return source.host_path, [volume]
    assert source.pvc is not None
    if site.local:
        raise _fail("model.source.pvc", "a PersistentVolumeClaim exists only in Kubernetes; locally use hostPath or hf")
    path = f"{MODEL_MOUNT}/{source.pvc.path.strip('/')}".rstrip("/")
    volume = Volume("model", MODEL_MOUNT, {"persistentVolumeClaim": {"claimName": source.pvc.claim_name}}, True)
    return path, [volume]


def _store(name: str, spec: UCMDeploymentSpec, site: Site) -> tuple[dict[str, Any], Role | None]:
    """The connector's store config, and the Mooncake master role when the deployment runs one."""
    st = spec.store
    config: dict[str, Any]
    master = None
    if st.type == "mooncake":
        assert st.mooncake is not None
        mc = st.mooncake
        if (mc.master is None) == (mc.address is None):
            raise _fail("store.mooncake", "set exactly one of master (run one here) or address (an external one)")
        if mc.master is not None:
            rpc = site.port("mooncake-master", mc.master.port)
            metadata = site.port("mooncake-master/metadata", mc.master.metadata_port)
            host = site.host(name, "mooncake-master")
            address, metadata_url = f"{host}:{rpc}", f"http://{host}:{metadata}/metadata"
            metrics = site.port("mooncake-master/metrics", MOONCAKE_METRICS_PORT)
            master = _mooncake_master(mc.master.image, rpc, metadata, metrics, site)
        else:
            if not mc.metadata_server:
                raise _fail("store.mooncake.metadataServer", "required with address (the master's metadata URL)")
            address, metadata_url = mc.address or "", mc.metadata_server
        config = {
            "mooncake": {
                "master_address": address,
                "metadata_server": metadata_url,
                # Other clients reach this pod at its own IP: `ucm serve` expands the variable.
                "local_hostname": "127.0.0.1" if site.local else "${POD_IP}",
                "global_segment_size": quantity_bytes(mc.segment_size, "store.mooncake.segmentSize"),
            }
        }
    else:
        root = st.ds3fs.mount_path if st.type == "ds3fs" and st.ds3fs is not None and site.local else site.kv_dir
        config = {st.type: {"roots": [root]}}
    spec_str = st.type
    if st.cache_size is not None:
        spec_str = f"cache|{st.type}"
        config["cache"] = {"capacity": quantity_bytes(st.cache_size, "store.cacheSize")}
    return {"spec": spec_str, **config}, master


def _kv_config(spec: UCMDeploymentSpec, store: dict[str, Any]) -> dict[str, Any]:
    try:
        return kv_transfer_config(
            store,
            "kv_both",
            hash_algorithm=spec.store.hashing.algorithm,
            salt=spec.store.hashing.salt,
            # Same id on every pod, whatever path the model is mounted at: blocks are shared.
            model_id=spec.model.served_name or _source_id(spec),
        )
    except ConfigError as exc:
        raise _fail("store", str(exc)) from None


def _source_id(spec: UCMDeploymentSpec) -> str:
    s = spec.model.source
    if s.hf is not None:
        return s.hf
    if s.host_path is not None:
        return s.host_path
    assert s.pvc is not None
    return f"pvc:{s.pvc.claim_name}/{s.pvc.path.strip('/')}"


def _store_volumes(spec: UCMDeploymentSpec, name: str, site: Site) -> list[Volume]:
    if site.local:
        return []
    st = spec.store
    if st.type == "posix":
        assert st.pvc is not None
        claim = st.pvc.claim_name or f"{name}-kv"
        return [Volume("kv", KV_MOUNT, {"persistentVolumeClaim": {"claimName": claim}})]
    if st.type == "nfs":
        assert st.nfs is not None
        return [Volume("kv", KV_MOUNT, {"nfs": {"server": st.nfs.server, "path": st.nfs.path}})]
    if st.type == "ds3fs":
        assert st.ds3fs is not None
        return [Volume("kv", KV_MOUNT, {"hostPath": {"path": st.ds3fs.mount_path, "type": "Directory"}})]
    return []


def _claim(spec: UCMDeploymentSpec, site: Site) -> dict[str, Any] | None:
    pvc = spec.store.pvc
    if site.local or spec.store.type != "posix" or pvc is None or pvc.create is None:
        return None
    size = pvc.create.size
    quantity_bytes(size, "store.pvc.create.size")
    claim: dict[str, Any] = {
        "accessModes": list(pvc.create.access_modes),
        "resources": {"requests": {"storage": str(size)}},
    }
    if pvc.create.storage_class_name:
        claim["storageClassName"] = pvc.create.storage_class_name
    return claim


def _engine(
    name: str,
    role_name: str,
    component: Component,
    replicas: int,
    port: int,
    pool: PoolSpec,
    spec: UCMDeploymentSpec,
    site: Site,
    model_path: str,
    model_volumes: list[Volume],
) -> Role:
    m = spec.model
    vllm = ["--model", model_path, "--served-model-name", m.served_name or _source_id(spec)]
    vllm += [
        "--dtype",
        m.dtype,
        "--block-size",
        str(m.block_size),
        "--tensor-parallel-size",
        str(m.tensor_parallel_size),
    ]
    if m.max_model_len is not None:
        vllm += ["--max-model-len", str(m.max_model_len)]
    vllm += ["--host", site.bind, "--port", str(port), "--enable-prompt-tokens-details"]
    vllm += [*m.extra_args, *pool.extra_args]
    command = ["ucm", "serve", "--kv-config", f"{site.config_dir}/{KV_CONFIG_FILE}", "--", *vllm]
    volumes = [*model_volumes, *_store_volumes(spec, name, site)]
    return Role(
        name=role_name,
        component=component,
        command=command,
        ports=[Port("http", port)],
        replicas=replicas,
        env={e.name: e.value for e in pool.env},
        files=[KV_CONFIG_FILE],
        volumes=volumes,
        readiness=Probe("http", "/health", period_s=5),
        liveness=Probe("http", "/health", period_s=10, failure_threshold=6),
        # Loading weights takes minutes on big models: liveness waits until the engine first answered.
        startup=Probe("http", "/health", period_s=10, failure_threshold=180),
        pool=pool,
        drain_delay_s=DRAIN_DELAY_S,
    )


def _proxy_config(name: str, spec: UCMDeploymentSpec, site: Site, port: int, engines: dict[str, list[str]]) -> str:
    p = spec.proxy
    config: dict[str, Any] = {
        "host": site.bind,
        "port": port,
        "mode": "pd",
        "routing": {"prefill": p.routing.prefill, "decode": p.routing.decode},
        "fallback_to_decode": p.fallback_to_decode,
    }
    if site.local:
        config["prefill"] = engines.get("prefill", [])
        config["decode"] = engines.get("decode", [])
    else:
        config["discovery"] = {
            "namespace": site.namespace,
            "prefill_service": f"{name}-prefill",
            "decode_service": f"{name}-decode",
            "port_name": "http",
        }
        if p.api_key_secret is not None:
            config["api_keys_file"] = f"{API_KEYS_DIR}/{p.api_key_secret.key}"
    try:
        ProxyConfig.model_validate(config)
    except ValidationError as exc:
        raise _fail("proxy", format_validation_error(exc, "proxy")) from None
    return yaml.safe_dump(config, sort_keys=False)


def _proxy(spec: UCMDeploymentSpec, site: Site, port: int) -> Role:
    p = spec.proxy
    volumes = []
    if p.api_key_secret is not None and not site.local:
        volumes.append(Volume("api-keys", API_KEYS_DIR, {"secret": {"secretName": p.api_key_secret.name}}, True))
    return Role(
        name="proxy",
        component="proxy",
        command=["ucm-proxy", "--config", f"{site.config_dir}/{PROXY_CONFIG_FILE}", "--log-level", "info"],
        ports=[Port("http", port)],
        replicas=p.replicas,
        files=[PROXY_CONFIG_FILE],
        volumes=volumes,
        readiness=Probe("http", "/ready", period_s=5),
        liveness=Probe("http", "/health", period_s=10),
        drain_delay_s=5,
        image=p.image or f"{PROXY_IMAGE}:{__version__}",
    )


def _mooncake_master(image: str | None, rpc: int, metadata: int, metrics: int, site: Site) -> Role:
    bind = site.bind
    return Role(
        name="mooncake-master",
        component="mooncake-master",
        command=[
            "mooncake_master",
            f"-rpc_address={bind}",
            f"-rpc_port={rpc}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={bind}",
            f"-http_metadata_server_port={metadata}",
            f"-metrics_host={bind}",
            f"-metrics_port={metrics}",
            "-enable_metric_reporting=false",
        ],
        ports=[Port("rpc", rpc), Port("metadata", metadata), Port("metrics", metrics)],
        readiness=Probe("rpc"),
        liveness=Probe("rpc", period_s=10),
        image=image,
    )
