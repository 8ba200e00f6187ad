"""``ucm serve``: start a vLLM OpenAI server with UCMConnector from a kv-transfer-config file.

The operator mounts that file from its ConfigMap and ``ucm up`` writes it to the run directory; both
start engines through this command, so the checks below run the same way everywhere: the config is
validated before vLLM loads a model, ``${VAR}`` references are filled from the environment (a pod's
own IP for Mooncake), and a store directory that is missing or read-only stops the start with a
message saying so (in Kubernetes that usually means the volume is not mounted).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ucm import engine_args
from ucm.config import ConfigError
from ucm.environment import apply_environment
from ucm.integration.vllm.config import WHERE, blend_overrides, native_config, parse_connector_config
from ucm.integration.vllm.health import HEALTH_FILE_ENV, IDENTITY_ENV, MIDDLEWARE, WARMUP_ENV, health_files
from ucm.integration.vllm.identity import pairing_identity
from ucm.store.factory import validate_store_config
from ucm.ucm_style import CONNECTOR_NAMES

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# What a pod learns about itself (Kubernetes' downward API): the only variables a config may name.
# Anything else (a token, a password) would end up in vLLM's argv, readable in /proc by the pod.
EXPANDABLE = frozenset({"POD_IP", "POD_NAME", "POD_NAMESPACE", "NODE_NAME"})


def load_kv_config(path: str | Path, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The file's kv-transfer-config, translated to our shape and validated, with ``${VAR}`` in
    string values filled in."""
    return expand_kv_config(native_kv_config(read_kv_config(path), path), path, environ)


def expand_kv_config(config: dict[str, Any], path: str | Path, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """``${VAR}`` in string values filled in, then validated.

    Expansion runs after parsing and only inside values, so a variable's content can never add
    keys or change the JSON's structure."""
    env = os.environ if environ is None else environ
    config = _expand(config, env, f"--kv-config: {path}: ")
    parse_connector_config(config["kv_connector_extra_config"])
    return config


def native_kv_config(config: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The kv-transfer-config in our shape: UCM's connector names and config keys translated (so
    the engine's argv shows what it runs, and a ``ucm_config_path`` file is read once, here)."""
    name = config.get("kv_connector", "UCMConnector")
    if name not in CONNECTOR_NAMES:
        raise ConfigError(f"--kv-config: {path}: kv_connector {name!r} is not UCM's ({', '.join(CONNECTOR_NAMES)})")
    return {
        **config,
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm.integration.vllm",
        "kv_connector_extra_config": native_config(config["kv_connector_extra_config"]),
    }


def read_kv_config(path: str | Path) -> dict[str, Any]:
    """The file's kv-transfer-config as written (``${VAR}`` references not filled in)."""
    try:
        config = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"--kv-config: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--kv-config: {path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("kv_connector_extra_config"), dict):
        raise ConfigError(f"--kv-config: {path} must be a kv-transfer-config with kv_connector_extra_config")
    return config


def _expand(value: Any, env: Mapping[str, str], where: str) -> Any:
    if isinstance(value, dict):
        return {k: _expand(v, env, f"{where}{k}.") for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, env, f"{where}{i}.") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def fill(m: re.Match[str]) -> str:
        name, field = m.group(1), where.rstrip(".")
        if name not in EXPANDABLE:
            raise ConfigError(f"{field}: ${{{name}}} may not be expanded; only {', '.join(sorted(EXPANDABLE))} may")
        if name not in env:
            raise ConfigError(f"{field} uses ${{{name}}}, which is not set in the environment")
        return env[name]

    return _VAR.sub(fill, value)


def check_store_dirs(config: dict[str, Any]) -> None:
    """Every directory a file-based store writes to (a stage with ``roots``) exists and takes a file."""
    for stage, options in validate_store_config(config["kv_connector_extra_config"]["store"]):
        for root in getattr(options, "roots", ()):
            where = f"{WHERE}.store.{stage}.roots: {root}"
            if not os.path.isdir(root):
                raise ConfigError(f"{where} does not exist (is the store volume mounted?)")
            try:
                with tempfile.NamedTemporaryFile(dir=root, prefix=".ucm-write-check-"):
                    pass
            except OSError as exc:
                raise ConfigError(
                    f"{where} is not writable ({exc.strerror}); check the volume and its permissions"
                ) from None


def vllm_command(config: dict[str, Any], vllm_args: list[str]) -> list[str]:
    transfer = ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    if (config.get("kv_connector_extra_config") or {}).get("blend") is not None:
        transfer += _blend_model_args(vllm_args)
    if "--headless" in vllm_args:  # a pod of a multi-node engine that holds ranks only: no server
        return [sys.executable, "-m", "ucm.integration.vllm.headless", *vllm_args, *transfer]
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        *vllm_args,
        "--middleware",
        MIDDLEWARE,
        *transfer,
    ]


def _blend_model_args(vllm_args: list[str]) -> list[str]:
    """An engine that blends runs UCM's Blend model class (ucm.integration.vllm.blend_model)."""
    if engine_args.setting(vllm_args, "hf_overrides"):
        raise ConfigError(
            f"{WHERE}.blend: ucm serve sets --hf-overrides to {json.dumps(blend_overrides())} for blending; "
            "remove yours (or run vllm serve yourself with both merged)"
        )
    return ["--hf-overrides", json.dumps(blend_overrides())]


def metrics_dir(environ: dict[str, str] | os._Environ[str]) -> str:
    """Where vLLM's processes share Prometheus samples: the engine's workers count UCM's metrics
    (store I/O, sparse attention) and the API server's ``/metrics`` adds up every process's files.
    A fresh directory per start unless the environment names one (stale files would count twice)."""
    return environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(prefix="ucm-metrics-")


def serve(kv_config: str, vllm_args: list[str], dry_run: bool = False) -> int:
    apply_environment(os.environ)
    written = native_kv_config(read_kv_config(kv_config), kv_config)  # ${VAR}s not filled in yet
    config = expand_kv_config(written, kv_config)
    check_store_dirs(config)
    command = vllm_command(config, vllm_args)
    if dry_run:
        print(json.dumps(command))
        return 0
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir(os.environ)
    health = os.environ.get(HEALTH_FILE_ENV) or os.path.join(tempfile.mkdtemp(prefix="ucm-health-"), "stuck.json")
    for left in health_files(Path(health)):  # left by a stuck store before a restart: not this start's state
        left.unlink(missing_ok=True)
    os.environ[HEALTH_FILE_ENV] = health
    os.environ[WARMUP_ENV] = "1"
    os.environ[IDENTITY_ENV] = pairing_identity(written["kv_connector_extra_config"], vllm_args)
    sys.stdout.flush()
    os.execv(command[0], command)
