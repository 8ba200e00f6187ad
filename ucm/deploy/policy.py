"""What a ``UCMDeployment`` may ask the operator for.

The operator's service account creates whatever a resource renders into, so whoever may create a
``UCMDeployment`` would otherwise choose any image, mount any node directory or NFS export,
schedule onto any node and let its engines load LoRA adapters from anywhere at runtime. The
platform team that installs the operator bounds that (chart values ``policy.*``, the operator's
``--allow-*`` flags); a spec outside the bounds is ``Degraded/InvalidSpec`` naming the field, and
nothing is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ucm import engine_args
from ucm.deploy import autoscaling, monitors
from ucm.deploy.autoscaling import Autoscaler
from ucm.deploy.monitors import Monitors
from ucm.deploy.pool import EnvFromSource, EnvVar, PoolSpec
from ucm.deploy.roles import fail
from ucm.deploy.spec import UCMDeploymentSpec
from ucm.vllm_options import OPTIONS

# vLLM options a spec may not pass, however spelled (ucm.engine_args reads them as vLLM
# does): they load code into the engine (remote code, a class or module by name, parser plugins, a
# logging config, which builds objects of any class it names), read options or files the spec
# does not show, or undo what the deployment decides (its key, address, connector).
REFUSED_FLAGS = {
    "--trust-remote-code": "runs code downloaded with the model",
    "--middleware": "loads code into the API server",
    "--tool-parser-plugin": "loads code into the API server",
    "--reasoning-parser-plugin": "loads code into the API server",
    "--worker-cls": "loads a class by name into the engine",
    "--worker-extension-cls": "loads a class by name into the engine",
    "--scheduler-cls": "loads a class by name into the engine",
    "--distributed-executor-backend": "may name an executor class to load into the engine",
    "--logits-processors": "loads classes by name into the engine",
    "--model-class-overrides": "loads model classes by name into the engine",
    "--ec-transfer-config": "loads an encoder-cache connector module into the engine",
    "--ec-manager-config": "loads an encoder-cache manager class by name into the engine",
    "--log-config-file": "a logging config builds objects of any class it names",
    "--logging-config": "a logging config file builds objects of any class it names (use --log-level)",
    "--config": "reads more options from a file in the pod, which no policy sees",
    "--allowed-local-media-path": "lets requests read files of the pod",
    "--api-key": "the deployment sets the engines' key",
    "--kv-transfer-config": "the deployment sets the connector",
    # vLLM connects its publisher to any endpoint not a wildcard: prompts' tokens would go wherever named.
    "--kv-events-config": "the deployment sets where engines publish their KV events (proxy.kvEvents)",
    "--host": "the deployment sets the address",
    "--port": "the deployment sets the port",
    # How an engine is split over ranks and pods: the deployment renders pods to match.
    "--tensor-parallel-size": "set <pool>.parallel.tensor",
    "--pipeline-parallel-size": "set <pool>.parallel.pipeline",
    "--nnodes": "set <pool>.parallel.nodes",
    "--node-rank": "the deployment numbers the pods of a multi-node engine (<pool>.parallel.nodes)",
    "--master-addr": "the deployment points a multi-node engine's pods at their leader",
    "--master-port": "the deployment points a multi-node engine's pods at their leader",
    "--headless": "the deployment runs the workers of a multi-node engine headless (<pool>.parallel.nodes)",
}
# The same by argparse dest, which every spelling of an option comes down to (a KeyError here: a
# refused flag vLLM no longer has; revise the list).
_REFUSED_DESTS = {OPTIONS[flag]: flag for flag in REFUSED_FLAGS}

# Keys of JSON-valued options a spec may not set, however written (the JSON value, a dotted
# sub-key): they name code the engine imports or runs. The options' other keys stay open.
REFUSED_KEYS = {
    "compilation_config": {
        "backend": "names a compiler backend the engine imports by qualified name",
        "inductor_passes": "names functions the engine imports (while reading its arguments)",
        "inductor_compile_config": "sets torch inductor's options, which name the compiler it runs",
        "cache_dir": "the engine loads compiled code from it",
    },
    "hf_overrides": {"auto_map": "names model classes to load as remote code"},
}

# Environment variables a spec may not set (env, or envFrom through its prefix) unless the operator
# allows them by name (--allow-env; the chart's policy.allowedEnv): they make the engine's
# processes load code, or move where they find it. That is code execution even with no writable
# volume: a model from the hub puts files its author chose at a known path in the pod.
REFUSED_ENV_PREFIXES = {
    # The dynamic loader reads LD_*: LD_PRELOAD and LD_AUDIT load libraries into every process,
    # LD_LIBRARY_PATH moves where they are found.
    "LD_": "the dynamic loader loads libraries it names",
    # Python reads PYTHON*: PYTHONPATH, PYTHONHOME, PYTHONUSERBASE and PYTHONPYCACHEPREFIX move where
    # code is imported from; PYTHONSTARTUP, PYTHONWARNINGS (a category's module) and
    # PYTHONBREAKPOINT import code. The rest tune the interpreter, which the image already does.
    "PYTHON": "Python imports code from where it says",
    # Functions every bash the engine starts defines.
    "BASH_FUNC_": "defines shell functions in every shell the engine starts",
    # Triton builds and loads GPU kernels from its cache and override directories and runs the
    # binaries (ptxas) it is pointed at; torch.compile's inductor loads compiled code from its caches.
    "TRITON_": "Triton loads kernels and runs binaries from where it says",
    "TORCHINDUCTOR_": "torch.compile loads compiled code from its caches",
}
REFUSED_ENV = {
    "GCONV_PATH": "glibc loads character-set modules from it",
    "PATH": "moves where every program the engine runs is found",
    "BASH_ENV": "a script every non-interactive bash runs first",
    "ENV": "a script every interactive sh runs first",
    "NODE_OPTIONS": "loads code into every Node.js process",
    "PERL5LIB": "moves where Perl loads code from",
    "PERL5OPT": "loads code into every Perl process",
    "PERLLIB": "moves where Perl loads code from",
    "OPENSSL_CONF": "an OpenSSL config loads engines and providers (libraries)",
    "OPENSSL_ENGINES": "where OpenSSL loads engines (libraries) from",
    "OPENSSL_MODULES": "where OpenSSL loads providers (libraries) from",
    "CUDA_INJECTION32_PATH": "CUDA loads this library into every process that uses it",
    "CUDA_INJECTION64_PATH": "CUDA loads this library into every process that uses it",
    "NVTX_INJECTION32_PATH": "NVTX loads this library into every process that uses it",
    "NVTX_INJECTION64_PATH": "NVTX loads this library into every process that uses it",
    "CUDA_CACHE_PATH": "CUDA loads compiled kernels from it",
    "OMP_TOOL_LIBRARIES": "OpenMP loads these libraries",
    "NCCL_NET_PLUGIN": "NCCL loads this library",
    "NCCL_TUNER_PLUGIN": "NCCL loads this library",
    "NCCL_PROFILER_PLUGIN": "NCCL loads this library",
    "NCCL_CONF_FILE": "NCCL reads its settings, its plugins among them, from this file",
    "CC": "the C compiler Triton runs to build its kernels' launchers",
    "CXX": "the C++ compiler torch.compile runs",
    "TORCH_EXTENSIONS_DIR": "torch loads compiled extensions from it",
    "TORCH_HOME": "torch.hub imports code from it",
    "HOME": "moves the caches compiled code is loaded from (~/.triton, ~/.cache)",
    "XDG_CACHE_HOME": "moves the caches compiled code is loaded from (vLLM's, Triton's)",
    "VLLM_CACHE_ROOT": "vLLM loads compiled code (torch.compile) from it",
    "VLLM_PLUGINS": "chooses which plugins vLLM loads",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "vLLM unpickles messages (code) with it",
    "VLLM_SERVER_DEV_MODE": "opens vLLM's development endpoints (calls into the engine's workers)",
    "VLLM_LOGGING_CONFIG_PATH": "a logging config builds objects of any class it names",
    "VLLM_NCCL_SO_PATH": "vLLM loads this library",
    "VLLM_CUDART_SO_PATH": "vLLM loads this library",
    "VLLM_CUDA_COMPATIBILITY_PATH": "vLLM loads libraries from it",
    "VLLM_RUST_FRONTEND_PATH": "vLLM runs this binary",
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Runtime adapter loading: with it an engine loads adapters it is asked for (/v1/load_lora_adapter,
# vLLM's resolver plugins) from paths and hub ids that no spec shows and this policy never sees.
# Refused unless the operator allows it for the deployment by name (--allow-runtime-lora).
RUNTIME_LORA_ENV = {
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "lets the engine load and unload adapters at runtime, from paths and hub "
    "ids the spec does not show",
    "VLLM_LORA_RESOLVER_CACHE_DIR": "a directory the engine loads adapters from at runtime",
    "VLLM_LORA_RESOLVER_HF_REPO_LIST": "hub repositories the engine downloads adapters from at runtime",
}
# What --allow-runtime-lora takes, in the dialect JSON Schema and Go share: the chart's values schema
# carries it, so that `helm install` refuses what the operator would stop at.
DEPLOYMENT_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$"

CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


@dataclass(frozen=True)
class Policy:
    # Image name prefixes a spec may use ("ucm/" allows ucm/runtime and ucm/proxy, the defaults).
    image_prefixes: tuple[str, ...] = ("ucm/",)
    # Node directories a spec may mount (model.source.hostPath, lora.adapters[].source.hostPath,
    # store.ds3fs.mountPath): none.
    host_path_prefixes: tuple[str, ...] = ()
    # Tolerations and node selection toward control-plane nodes, and match-everything tolerations.
    any_scheduling: bool = False
    # Not a bound but the cluster's fact the spec is checked against too: what scales a pool.
    autoscaler: Autoscaler = dataclasses.field(default_factory=Autoscaler)
    # Another cluster fact: whether Prometheus Operator monitors are rendered, labelled how.
    monitors: Monitors = dataclasses.field(default_factory=Monitors)
    # Refused environment variables (REFUSED_ENV, REFUSED_ENV_PREFIXES) specs may set all the same.
    allowed_env: tuple[str, ...] = ()
    # NFS exports a spec may mount inline (store.nfs), as (server, path prefix): none. Engine pods
    # mount it read-write, so naming another team's export would read its blocks and plant others.
    nfs_exports: tuple[tuple[str, str], ...] = ()
    # Deployments (namespace/name) whose engines may load LoRA adapters at runtime (RUNTIME_LORA_ENV).
    runtime_lora: tuple[str, ...] = ()

    def check(self, spec: UCMDeploymentSpec, namespace: str, name: str) -> None:
        """Raises :class:`PlanError` naming the first field outside the bounds; ``namespace`` and
        ``name`` are the resource's, which bounds given per deployment are looked up by."""
        images = [("image.repository", spec.image.repository), ("proxy.image", spec.proxy.image)]
        if spec.store.type == "mooncake" and spec.store.mooncake.master is not None:  # type: ignore[attr-defined]
            images.append(("store.mooncake.master.image", spec.store.mooncake.master.image))  # type: ignore[attr-defined]
        for field, image in images:
            if image is not None and not image.startswith(self.image_prefixes):
                raise fail(field, f"{image} is not from an allowed repository ({', '.join(self.image_prefixes)})")
        paths = [("model.source.hostPath", spec.model.source.host_path)]
        for i, adapter in enumerate(spec.lora.adapters if spec.lora is not None else ()):
            paths.append((f"lora.adapters[{i}].source.hostPath", adapter.source.host_path))
        if spec.store.type == "ds3fs":
            paths.append(("store.ds3fs.mountPath", spec.store.ds3fs.mount_path))  # type: ignore[attr-defined]
        for field, path in paths:
            if path is not None:
                self._host_path(field, path)
        if spec.store.type == "nfs":
            self._nfs(spec.store.nfs.server, spec.store.nfs.path)  # type: ignore[attr-defined]
        _refused_args("model.extraArgs", spec.model.extra_args)
        for pool_name, pool in (("prefill", spec.prefill), ("decode", spec.decode)):
            _refused_args(f"{pool_name}.extraArgs", pool.extra_args)
            self._env(pool_name, pool.env, pool.env_from, f"{namespace}/{name}")
            if not self.any_scheduling:
                _scheduling(pool_name, pool)
        self.autoscaler.check(spec)

    def _host_path(self, field: str, path: str) -> None:
        if not _under(path, self.host_path_prefixes):
            listed = ", ".join(self.host_path_prefixes) or "none: the operator allows no node directories"
            raise fail(field, f"{path} is not under an allowed host path ({listed})")

    def _nfs(self, server: str, path: str) -> None:
        # Servers match exactly: another spelling may be another machine (and refusing it is safe).
        prefixes = [prefix for allowed, prefix in self.nfs_exports if allowed == server]
        if _under(path, prefixes):
            return
        listed = ", ".join(f"{s}:{p}" for s, p in self.nfs_exports) or "none"
        raise fail(
            "store.nfs.path" if prefixes else "store.nfs.server",
            f"{server}:{path} is not allowed by the operator's policy (allowed: {listed}; "
            "see policy.allowedNfs, --allow-nfs)",
        )

    def _env(self, pool_name: str, env: list[EnvVar], env_from: list[EnvFromSource], deployment: str) -> None:
        runtime_lora = deployment in self.runtime_lora
        for i, e in enumerate(env):
            why = _refused_env(e.name)
            if why is not None and e.name not in self.allowed_env:
                raise fail(
                    f"{pool_name}.env[{i}].name",
                    f"{e.name} is not allowed: {why} (unless the operator's policy allows it by name)",
                )
            if e.name in RUNTIME_LORA_ENV and not runtime_lora:
                raise fail(f"{pool_name}.env[{i}].name", _runtime_lora_refused(e.name, deployment))
        for i, source in enumerate(env_from):
            reached = self._reachable(source.prefix, runtime_lora)
            if reached is not None:
                name, why = reached
                how = f"{source.prefix!r} and a key" if source.prefix else "without a prefix, a key"
                raise fail(
                    f"{pool_name}.envFrom[{i}].prefix",
                    f"{how} of the Secret or ConfigMap could make {name}, which is not allowed: {why}; give a "
                    "prefix no refused name starts with, or name each variable in env",
                )

    def _reachable(self, prefix: str, runtime_lora: bool) -> tuple[str, str] | None:
        """A refused name that ``prefix`` and some key make (envFrom), and why it is refused."""
        for start, why in REFUSED_ENV_PREFIXES.items():
            if start.startswith(prefix) or prefix.startswith(start):
                return f"{start}*", why
        for name, why in REFUSED_ENV.items():
            if name.startswith(prefix) and name != prefix and name not in self.allowed_env:
                return name, why
        for name, why in RUNTIME_LORA_ENV.items():
            if name.startswith(prefix) and name != prefix and not runtime_lora:
                return name, f"{why} (unless the operator's policy allows runtime adapters for this deployment)"
        return None


def _runtime_lora_refused(variable: str, deployment: str) -> str:
    return (
        f"{variable} is not allowed: {RUNTIME_LORA_ENV[variable]}; serve adapters from spec.lora, or have the "
        f"operator allow runtime adapters for this deployment (--allow-runtime-lora {deployment}, the chart's "
        "policy.allowedRuntimeLora)"
    )


def _under(path: str, prefixes: Iterable[str]) -> bool:
    """Whether the absolute ``path`` is one of ``prefixes`` or below one. Compared normalized, as
    the node or server resolves it: /a/b/../../etc is /etc, and /exports/ab is not below /exports/a."""
    normal = posixpath.normpath(path)
    return path.startswith("/") and any(
        normal == p.rstrip("/") or normal.startswith(p.rstrip("/") + "/") for p in prefixes
    )


def _refused_args(field: str, args: list[str]) -> None:
    for i, arg in enumerate(args):
        following = args[i + 1] if i + 1 < len(args) else None
        try:
            read = engine_args.dests(arg)
            keys = [(dest, engine_args.json_keys(arg, following)) for dest in read if dest in REFUSED_KEYS]
        except engine_args.EngineArgError as exc:
            raise fail(f"{field}[{i}]", str(exc)) from None
        written = arg.partition("=")[0]
        for dest in read:
            if dest in _REFUSED_DESTS:
                flag = _REFUSED_DESTS[dest]
                how = "" if written == flag else f" (vLLM reads {written} as {flag})"
                raise fail(f"{field}[{i}]", f"{flag} is not allowed: {REFUSED_FLAGS[flag]}{how}")
        for dest, set_keys in keys:
            refused = sorted(set_keys & REFUSED_KEYS[dest].keys())
            if refused:
                why = REFUSED_KEYS[dest][refused[0]]
                raise fail(f"{field}[{i}]", f"{written}: the key {refused[0]} is not allowed: {why}")


def allowable_env_pattern() -> str:
    """The names ``--allow-env`` takes (those refused otherwise), as a regular expression in the
    dialect JSON Schema and Go share: the chart's values schema carries it, so that ``helm install``
    refuses a name the operator would stop at."""
    prefixes = "|".join(re.escape(p) for p in REFUSED_ENV_PREFIXES)
    names = "|".join(re.escape(n) for n in REFUSED_ENV)
    return f"^(?:(?:{prefixes})[A-Za-z0-9_]*|{names})$"


def _refused_env(name: str) -> str | None:
    """Why a spec may not set the environment variable ``name``; None where it may."""
    for start, why in REFUSED_ENV_PREFIXES.items():
        if name.startswith(start):
            return why
    return REFUSED_ENV.get(name)


def _scheduling(pool_name: str, pool: PoolSpec) -> None:
    for key in pool.node_selector:
        if key in CONTROL_PLANE_LABELS:
            raise fail(f"{pool_name}.nodeSelector.{key}", "engines may not be placed on control-plane nodes")
    for i, t in enumerate(pool.tolerations):
        key = t.get("key")
        if not key:
            raise fail(f"{pool_name}.tolerations[{i}]", "a toleration needs a key (one without tolerates every taint)")
        if key in CONTROL_PLANE_LABELS:
            raise fail(f"{pool_name}.tolerations[{i}].key", "engines may not tolerate control-plane taints")
    if pool.affinity and _mentions(pool.affinity, CONTROL_PLANE_LABELS):
        raise fail(f"{pool_name}.affinity", "engines may not be placed on control-plane nodes")


def _mentions(value: Any, words: tuple[str, ...]) -> bool:
    if isinstance(value, dict):
        return any(_mentions(v, words) for v in value.values())
    if isinstance(value, list):
        return any(_mentions(v, words) for v in value)
    return isinstance(value, str) and value in words


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bounds as flags: the operator's (set from the chart's ``policy.*``) and ``ucm render``'s,
    which checks a resource against the same bounds before anyone applies it."""
    bounds = p.add_argument_group("what a UCMDeployment may ask for (ucm.deploy.policy)")
    bounds.add_argument(
        "--allow-image-prefix", action="append", help="an image name prefix specs may use (repeatable; default: ucm/)"
    )
    bounds.add_argument(
        "--allow-host-path",
        action="append",
        default=[],
        help="a node directory specs may mount (repeatable; none by default)",
    )
    bounds.add_argument(
        "--allow-any-scheduling", action="store_true", help="pass control-plane placement and keyless tolerations"
    )
    bounds.add_argument(
        "--allow-env",
        action="append",
        default=[],
        metavar="NAME",
        help="an environment variable specs may set though it loads code (LD_PRELOAD, PYTHONPATH, ...: "
        "ucm.deploy.policy.REFUSED_ENV; repeatable)",
    )
    bounds.add_argument(
        "--allow-nfs",
        action="append",
        default=[],
        metavar="SERVER:/PREFIX",
        help="an NFS export specs may mount inline (store.nfs): the server exactly, the path at or under "
        "PREFIX (repeatable; none by default)",
    )
    bounds.add_argument(
        "--allow-runtime-lora",
        action="append",
        default=[],
        metavar="NAMESPACE/NAME",
        help="a UCMDeployment whose engines may load LoRA adapters at runtime (VLLM_ALLOW_RUNTIME_LORA_UPDATING "
        "and vLLM's resolver variables in its pools' env; repeatable; none by default)",
    )
    autoscaling.add_arguments(p)
    monitors.add_arguments(p)


def from_args(args: argparse.Namespace) -> Policy:
    return Policy(
        image_prefixes=tuple(args.allow_image_prefix or Policy.image_prefixes),
        host_path_prefixes=tuple(args.allow_host_path),
        any_scheduling=args.allow_any_scheduling,
        autoscaler=autoscaling.from_args(args),
        monitors=monitors.from_args(args),
        allowed_env=_allowed_env(args.allow_env),
        nfs_exports=tuple(_nfs_export(value) for value in args.allow_nfs),
        runtime_lora=tuple(_deployment(value) for value in args.allow_runtime_lora),
    )


def _allowed_env(names: list[str]) -> tuple[str, ...]:
    for name in names:
        if not _ENV_NAME.fullmatch(name):
            raise SystemExit(f"--allow-env: {name!r} is not an environment variable name")
        if name in RUNTIME_LORA_ENV:
            raise SystemExit(f"--allow-env: {name} is allowed per deployment: --allow-runtime-lora NAMESPACE/NAME")
        if _refused_env(name) is None:
            raise SystemExit(f"--allow-env: {name} is not refused (specs may set it already)")
    return tuple(names)


def _nfs_export(value: str) -> tuple[str, str]:
    # Split at the first ":/": a server has no "/", and an IPv6 address has colons of its own.
    server, sep, rest = value.partition(":/")
    if not server or not sep or "/" in server:
        raise SystemExit(f"--allow-nfs: {value!r} is not SERVER:/PATH")
    return server, "/" + rest


def _deployment(value: str) -> str:
    if not re.match(DEPLOYMENT_PATTERN, value):
        raise SystemExit(f"--allow-runtime-lora: {value!r} is not NAMESPACE/NAME (a UCMDeployment's)")
    return value
