"""A ``UCMDeployment`` spec as a plain plan of roles: what runs, with which command, ports, probes,
volumes and config files.

Two executors read the same plan: the Kubernetes renderer (``ucm.deploy.kubernetes``, used by the
operator and ``ucm render``) and the local one (``ucm.deploy.local``, ``ucm up``). What differs
between them is only *where* things are — ports, addresses, paths — and that is the :class:`Site`.

Every flag and config format here comes from the component that owns it: the connector's
``kv_transfer_config``, the store kind's module, the proxy's own options (passed through as data;
the proxy validates them: ``ucm-proxy --check``). A spec that the CRD accepts but that cannot work
raises :class:`PlanError` naming the field (the operator reports it as ``Degraded/InvalidSpec``).
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from ucm import __version__, engine_args
from ucm.config import ConfigError
from ucm.deploy.lora import Rendered, refuse_in_extra_args
from ucm.deploy.lora import render as render_lora
from ucm.deploy.pool import PoolSpec
from ucm.deploy.roles import (
    BACKEND_KEY,
    CREDENTIALS,
    ENGINES,
    MAC_KEY,
    METRICS_TOKEN,
    Component,
    Group,
    Plan,
    Port,
    Probe,
    Role,
    SecretRef,
    Site,
    Volume,
    credentials_secret,
    fail,
    quantity_bytes,
)
from ucm.deploy.spec import FILE_KINDS, FileStoreSpec, UCMDeploymentSpec
from ucm.integration.vllm.config import kv_transfer_config
from ucm.kv_events import KV_EVENTS_PORT, KV_EVENTS_TOPIC, KV_REPLAY_PORT, ipc_event_endpoints

PROXY_IMAGE = "ucm/proxy"  # runtime/Dockerfile.proxy; `make images` tags it with the release
KV_CONFIG_FILE = "kv-transfer-config.json"
KV_DECODE_CONFIG_FILE = "kv-transfer-config-decode.json"  # with spec.sparse or blend: what decode engines read
PROXY_CONFIG_FILE = "proxy.yaml"
BACKENDS_FILE = "backends.json"  # locally: the proxy's backends, rewritten by `ucm restart`
API_KEYS_DIR = "/etc/ucm/api-keys"
MODEL_MOUNT = "/models"
# A store on a claim the deployment creates keeps this share of it: the rest is room for the file
# system's own use and the blocks written while an eviction pass runs.
DEFAULT_CAPACITY_SHARE = 0.9
VLLM_PORT = 8000
PROXY_PORT = 8000
# Seconds a stopping pod keeps serving after it leaves its Service's endpoints: the proxy's
# EndpointSlice watch sees it go first, so no new request is routed to a dying engine.
DRAIN_DELAY_S = 10
# What the LeaderWorkerSet controller sets in every container of a group, for Kubernetes to expand
# in the command: the leader pod's address, and this pod's index in its group (the leader's is 0).
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
WORKER_INDEX = "$(LWS_WORKER_INDEX)"
# Proxy options the deployment decides; proxy.config may not set them.
PROXY_PLANNED = (
    "host",
    "port",
    "mode",
    "prefill",
    "decode",
    "discovery",
    "backends_file",
    "api_keys",
    "api_keys_file",
    "backend_api_key_file",
    "metrics_token_file",
)


def _cpu_engines(spec: UCMDeploymentSpec) -> None:
    """Sparse attention and Blend run inside vLLM's CPU attention backend: on a GPU engine sparse would
    do nothing and Blend would stop it at start. (The GPU kernels in runtime/native serve no request
    yet.) Locally the engines are this machine's vLLM, which says so itself; in a cluster the pool's
    GPUs tell."""
    for field, pool in (("sparse", "decode"), ("blend", "prefill")):
        gpus = getattr(spec, pool).resources.gpus
        if getattr(spec, field) is not None and gpus:
            raise fail(
                field,
                f"runs on CPU engines only (vLLM's CPU attention backend), and {pool}.resources.gpus is {gpus}: "
                f"set it to 0 (the runtime's CPU image) or leave {field} out",
            )


def engine_dtype(spec: UCMDeploymentSpec, site: Site) -> str:
    """The engines' ``--dtype``: the model's, but float32 for ``auto`` on a machine of ``ucm up`` whose
    CPU has no bfloat16 arithmetic (``ucm.cpu``). In a cluster the nodes' CPUs are not known here:
    the engine says so in its log (``ucm.integration.vllm.attention``). A ``--dtype`` among the
    extra arguments is the user's choice: it comes later and wins."""
    chosen = [*spec.model.extra_args, *(a for pool in ENGINES for a in getattr(spec, pool).extra_args)]
    if (
        spec.model.dtype == "auto"
        and site.local
        and not site.native_bfloat16
        and not engine_args.setting(chosen, "dtype")
    ):
        return "float32"
    return spec.model.dtype


def _eager_pipelines(spec: UCMDeploymentSpec, site: Site) -> None:
    """vLLM 0.32's CPU model runner allocates a later pipeline stage's buffer for the hidden states
    it receives only in the compile warm-up, which ``--enforce-eager`` skips: such an engine starts,
    then dies on its first request. Locally every engine is the CPU build; in a cluster a pool
    without GPUs runs the CPU image."""
    for pool_name in ENGINES:
        pool = getattr(spec, pool_name)
        if pool.parallel.pipeline == 1 or (pool.resources.gpus and not site.local):
            continue
        hits = [(f"model.extraArgs[{i}]", a) for i, a in engine_args.setting(spec.model.extra_args, "enforce_eager")]
        hits += [(f"{pool_name}.extraArgs[{i}]", a) for i, a in engine_args.setting(pool.extra_args, "enforce_eager")]
        if not hits or engine_args.turns_off(hits[-1][1]):  # the last one wins, the pool's after the model's
            continue
        field, arg = hits[-1]
        raise fail(
            field,
            f"{arg}: vLLM's CPU build cannot run pipeline parallelism eagerly ({pool_name}.parallel.pipeline "
            f"is {pool.parallel.pipeline}; a later stage fails on the first request): leave it out, or set the "
            "pipeline to 1",
        )


def _blend_args(spec: UCMDeploymentSpec) -> None:
    """With blend, ``ucm serve`` gives prefill engines ``--hf-overrides`` (UCM's Blend model class) and
    refuses one of the spec's: say so here, not in a crash-looping pod."""
    for field, args in (("model.extraArgs", spec.model.extra_args), ("prefill.extraArgs", spec.prefill.extra_args)):
        for i, arg in engine_args.setting(args, "hf_overrides"):
            raise fail(
                f"{field}[{i}]",
                f"{arg.partition('=')[0]}: set by the deployment with blend (UCM's Blend model class); "
                "leave it out, or leave blend out",
            )


def build_plan(name: str, spec: UCMDeploymentSpec, site: Site) -> Plan:
    """The roles of one deployment. Raises :class:`PlanError` for a spec that cannot work."""
    store = spec.store
    kind, opts = store.kind, store.options
    roles: list[Role] = list(kind.roles(opts, name, site))
    files: dict[str, str] = {}
    model_path, model_volumes = _model(spec, site)
    lora = _lora(spec, site)
    store_volumes = kind.volumes(opts, name, site)
    stage = _file_options(spec, kind.connector(opts, name, site))
    credentials = [BACKEND_KEY, METRICS_TOKEN] if spec.proxy.metrics_auth else [BACKEND_KEY]
    if store.mac:
        (backend,) = stage
        stage = {backend: {**stage[backend], "mac_key_file": f"{site.credentials_dir}/{MAC_KEY}"}}
        credentials.append(MAC_KEY)
        store_volumes = [*store_volumes, *_credentials_volume(name, site, MAC_KEY)]
    if not site.local:
        _cpu_engines(spec)
    _eager_pipelines(spec, site)
    if spec.blend is not None:
        _blend_args(spec)
    # Prefill is where Blend pays, decoding where sparse attention does: each pool its own settings.
    files[KV_CONFIG_FILE] = _json(_kv_config(spec, stage, blend=True))
    kv_files = {"prefill": KV_CONFIG_FILE, "decode": KV_CONFIG_FILE}
    if spec.sparse is not None or spec.blend is not None:
        files[KV_DECODE_CONFIG_FILE] = _json(_kv_config(spec, stage, sparse=True))
        kv_files["decode"] = KV_DECODE_CONFIG_FILE
    engines: dict[str, list[str]] = {}
    for component, pool in (("prefill", spec.prefill), ("decode", spec.decode)):
        instances = (
            [(f"{component}-{i}", 1) for i in range(pool.replicas)] if site.local else [(component, pool.replicas)]
        )
        for role_name, replicas in instances:
            port = site.port(role_name, VLLM_PORT)
            volumes = [*model_volumes, *(lora.volumes if lora else ()), *store_volumes]
            role = _engine(
                name,
                role_name,
                component,
                replicas,
                port,
                pool,
                spec,
                site,
                model_path,
                volumes,
                kv_files[component],
                lora,
            )
            roles.append(role)
            engines.setdefault(component, []).append(f"http://{site.host(name, role_name)}:{port}")
    proxy_port = site.port("proxy", PROXY_PORT)
    files[PROXY_CONFIG_FILE] = _proxy_config(name, spec, site, proxy_port)
    if site.local:
        files[BACKENDS_FILE] = backends_json(engines)
    roles.append(_proxy(name, spec, site, proxy_port))
    claim = kind.claim(opts, site)
    return Plan(
        name=name,
        roles=roles,
        files=files,
        store_claim=claim,
        store_claim_retained=claim is not None and kind.retained(opts),
        store_external=None if claim is not None else kind.external(opts),
        credentials=tuple(credentials),
    )


def _model(spec: UCMDeploymentSpec, site: Site) -> tuple[str, list[Volume]]:
    source = spec.model.source
    if source.hf is not None:
        return source.hf, []
    if source.host_path is not None:
        if site.local:
            return source.host_path, []
        # At a fixed point, read-only: a node path mounted where it is could cover the image's own
        # directories (/usr, /etc).
        volume = Volume("model", MODEL_MOUNT, {"hostPath": {"path": source.host_path, "type": "Directory"}}, True)
        return MODEL_MOUNT, [volume]
    assert source.pvc is not None
    if site.local:
        raise fail("model.source.pvc", "a PersistentVolumeClaim exists only in Kubernetes; locally use hostPath or hf")
    path = f"{MODEL_MOUNT}/{source.pvc.path.strip('/')}".rstrip("/")
    volume = Volume("model", MODEL_MOUNT, {"persistentVolumeClaim": {"claimName": source.pvc.claim_name}}, True)
    return path, [volume]


def _lora(spec: UCMDeploymentSpec, site: Site) -> Rendered | None:
    """``spec.lora`` as every engine of both pools gets it: the same flags and mounts in each, the
    only place adapters come from (extra arguments may not add any)."""
    for field, args in (
        ("model.extraArgs", spec.model.extra_args),
        ("prefill.extraArgs", spec.prefill.extra_args),
        ("decode.extraArgs", spec.decode.extra_args),
    ):
        refuse_in_extra_args(field, args)
    if spec.lora is None:
        return None
    source = spec.model.source
    # An adapter on the model's claim is read where the model's volume has it.
    mounted = {source.pvc.claim_name: MODEL_MOUNT} if source.pvc is not None else {}
    return render_lora(spec.lora, site, mounted)


def _json(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _kv_config(
    spec: UCMDeploymentSpec, stage: dict[str, Any], sparse: bool = False, blend: bool = False
) -> dict[str, Any]:
    """The connector's kv-transfer-config: the kind's store stage, behind a DRAM tier if asked;
    with ``sparse`` or ``blend``, the deployment's sparse attention or Blend settings too."""
    (backend,) = stage
    store: dict[str, Any] = {"spec": backend, **stage}
    if spec.store.cache_size is not None:
        store["spec"] = f"cache|{backend}"
        store["cache"] = {"capacity": quantity_bytes(spec.store.cache_size, "store.cacheSize")}
    extra: dict[str, Any] = spec.connector.model_dump(exclude_unset=True)
    if sparse and spec.sparse is not None:
        extra["sparse"] = spec.sparse.model_dump(mode="json", exclude_unset=True)
    if blend and spec.blend is not None:
        extra["blend"] = spec.blend.model_dump(mode="json", exclude_unset=True)
    if spec.store_tp is not None:  # pools of different TP: both keep blocks in the larger TP's shares
        extra["store_tp"] = spec.store_tp
    try:
        return kv_transfer_config(
            store,
            "kv_both",
            hash_algorithm=spec.store.hashing.algorithm,
            salt=spec.store.hashing.salt,
            # Same id on every pod, whatever path the model is mounted at: blocks are shared.
            model_id=spec.model.served,
            **extra,
        )
    except ConfigError as exc:
        raise fail("store", str(exc)) from None


def _file_options(spec: UCMDeploymentSpec, stage: dict[str, Any]) -> dict[str, Any]:
    """``store.files`` on a file store's stage (what is set; the store's defaults otherwise), and a
    capacity by default where the volume's size is known: a claim the deployment creates."""
    store = spec.store
    if store.type not in FILE_KINDS:
        return stage
    files = store.files or FileStoreSpec()
    options = files.model_dump(exclude_unset=True, exclude={"capacity"})
    size = store.kind.known_size(store.options)
    if files.capacity is not None:
        options["capacity"] = quantity_bytes(files.capacity, "store.files.capacity")
    elif size is not None:
        options["capacity"] = int(size * DEFAULT_CAPACITY_SHARE)
    (backend,) = stage
    return {backend: {**stage[backend], **options}}


def _engine(
    deployment: str,
    role_name: str,
    component: Component,
    replicas: int,
    port: int,
    pool: PoolSpec,
    spec: UCMDeploymentSpec,
    site: Site,
    model_path: str,
    volumes: list[Volume],
    kv_file: str,
    lora: Rendered | None,
) -> Role:
    m, parallel = spec.model, pool.parallel
    vllm = ["--model", model_path, "--served-model-name", m.served]
    vllm += [
        "--dtype",
        engine_dtype(spec, site),
        "--block-size",
        str(m.block_size),
        "--tensor-parallel-size",
        str(parallel.tensor),
    ]
    if parallel.pipeline > 1:
        vllm += ["--pipeline-parallel-size", str(parallel.pipeline)]
    if m.max_model_len is not None:
        vllm += ["--max-model-len", str(m.max_model_len)]
    if lora is not None:
        vllm += lora.args
    vllm += ["--host", site.bind, "--port", str(port), "--enable-prompt-tokens-details"]
    # On SIGTERM vLLM finishes the requests it holds for up to this long (its default, 0, aborts them;
    # the HTTP requests of aborted ones were seen hanging until the process was killed).
    vllm += ["--shutdown-timeout", str(pool.drain_timeout_s)]
    vllm += [*m.extra_args, *pool.extra_args]
    ports = [Port("http", port)]
    if component == "prefill" and spec.proxy.kv_events:  # the pool kv_aware routes among
        if site.local:
            endpoints = ipc_event_endpoints(deployment, port)
        else:
            endpoints = f"tcp://*:{KV_EVENTS_PORT}", f"tcp://*:{KV_REPLAY_PORT}"
        vllm += ["--kv-events-config", kv_events_config(*endpoints)]
        if not site.local:
            ports += [Port("kv-events", KV_EVENTS_PORT), Port("kv-replay", KV_REPLAY_PORT)]
    command = ["ucm", "serve", "--kv-config", f"{site.config_dir}/{kv_file}", "--", *vllm]
    group = None
    if parallel.nodes > 1:
        # vLLM's multiprocessing executor across pods: rank 0's pod serves, the others join it headless.
        # Locally the "pods" are processes on loopback, and each start picks the rendezvous port.
        leader = "127.0.0.1" if site.local else LEADER_ADDRESS
        nodes = ["--nnodes", str(parallel.nodes), "--master-addr", leader]
        group = Group(
            size=parallel.nodes,
            worker_command=[*command, *nodes, "--node-rank", WORKER_INDEX, "--headless"],
            topology_key=parallel.topology_key,
        )
        command = [*command, *nodes, "--node-rank", "0"]
    secret_env = {"VLLM_API_KEY": SecretRef(credentials_secret(deployment), BACKEND_KEY)}
    for i, e in enumerate(pool.env):
        if e.name in ("VLLM_API_KEY", "POD_IP", "POD_NAME"):
            raise fail(f"{component}.env[{i}].name", f"{e.name} is set by the deployment")
        if e.value_from is not None:
            secret_env[e.name] = SecretRef(e.value_from.secret_key_ref.name, e.value_from.secret_key_ref.key)
    return Role(
        name=role_name,
        component=component,
        command=command,
        ports=ports,
        replicas=replicas,
        env={e.name: e.value for e in pool.env if e.value is not None},
        # Only the proxy may call an engine: it alone holds the key (clients' keys stay at the proxy).
        secret_env=secret_env,
        files=[kv_file],
        volumes=volumes,
        readiness=Probe("http", "/health", period_s=5),
        liveness=Probe("http", "/health", period_s=10, failure_threshold=6),
        # Loading weights takes minutes on big models: liveness waits until the engine first answered.
        startup=Probe("http", "/health", period_s=10, failure_threshold=180),
        pool=pool,
        drain_delay_s=DRAIN_DELAY_S,
        drain_timeout_s=pool.drain_timeout_s,
        group=group,
        steps=lora.steps if lora is not None else [],
    )


def kv_events_config(events: str, replay: str) -> str:
    """vLLM's --kv-events-config publishing on ``events`` with its replay on ``replay``: endpoints it
    binds (a wildcard or ipc one; it connects to any other), where the proxy's ``routing.kv_events``
    looks for them."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
        "topic": KV_EVENTS_TOPIC,
    }
    return json.dumps(config, separators=(",", ":"), sort_keys=True)


def backends_json(engines: dict[str, list[str]]) -> str:
    return _json({"prefill": engines.get("prefill", []), "decode": engines.get("decode", [])})


def _proxy_config(name: str, spec: UCMDeploymentSpec, site: Site, port: int) -> str:
    """The proxy's config file: the user's ``proxy.config`` plus what the deployment decides."""
    p = spec.proxy
    for key in PROXY_PLANNED:
        if key in p.config:
            decided = "pools, proxy.service, proxy.apiKeySecret, proxy.metricsAuth"
            raise fail(f"proxy.config.{key}", f"set by the deployment ({decided})")
    config: dict[str, Any] = {**p.config, "host": site.bind, "port": port, "mode": "pd"}
    if p.kv_events:
        routing = config.get("routing")
        if isinstance(routing, dict) and "kv_events" in routing:
            raise fail("proxy.config.routing.kv_events", "set by the deployment (proxy.kvEvents)")
        where = {"ipc_name": name} if site.local else {"port": KV_EVENTS_PORT, "replay_port": KV_REPLAY_PORT}
        config["routing"] = {**(routing if isinstance(routing, dict) else {}), "kv_events": where}
    disaggregation = config.get("disaggregation", {})
    if spec.blend is not None and isinstance(disaggregation, dict):
        # Blend runs on prefill: a prompt the proxy judged short or stored and sent straight to decode
        # would be computed in full there. Every request goes through prefill, unless the user says.
        config["disaggregation"] = {"min_prefill_tokens": 0, **disaggregation}
    config["backend_api_key_file"] = f"{site.credentials_dir}/{BACKEND_KEY}"
    if p.metrics_auth:
        config["metrics_token_file"] = f"{site.credentials_dir}/{METRICS_TOKEN}"
    if site.local:
        config["backends_file"] = f"{site.config_dir}/{BACKENDS_FILE}"
    else:
        config["discovery"] = {
            "namespace": site.namespace,
            "prefill_service": f"{name}-prefill",
            "decode_service": f"{name}-decode",
            "port_name": "http",
            "resource": name,
        }
        if p.api_key_secret is not None:
            config["api_keys_file"] = f"{API_KEYS_DIR}/{p.api_key_secret.key}"
    return yaml.safe_dump(config, sort_keys=False)


def _credentials_volume(name: str, site: Site, *keys: str) -> list[Volume]:
    """Generated keys as files (locally the run directory holds them all already)."""
    if site.local:
        return []
    own = {"secretName": credentials_secret(name), "items": [{"key": key, "path": key} for key in keys]}
    return [Volume(CREDENTIALS, site.credentials_dir, {"secret": own}, True)]


def _proxy(name: str, spec: UCMDeploymentSpec, site: Site, port: int) -> Role:
    p = spec.proxy
    if p.service.type != "ClusterIP" and p.api_key_secret is None and not p.allow_anonymous:
        raise fail(
            "proxy.apiKeySecret",
            f"required with proxy.service.type {p.service.type} (reachable from outside the cluster); "
            "set proxy.allowAnonymous: true to serve it without keys",
        )
    volumes = []
    if p.api_key_secret is not None and not site.local:
        # Only the named key: the Secret may hold others the proxy has no business reading.
        only = {
            "secretName": p.api_key_secret.name,
            "items": [{"key": p.api_key_secret.key, "path": p.api_key_secret.key}],
        }
        volumes.append(Volume("api-keys", API_KEYS_DIR, {"secret": only}, True))
    volumes += _credentials_volume(name, site, BACKEND_KEY, *([METRICS_TOKEN] if p.metrics_auth else []))
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
