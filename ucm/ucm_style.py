"""UCM's own configuration read as ours: ``ucm_config.yaml``, ``ucm_connectors``, store names.

People arriving from UCM's documentation bring its shape::

    ucm_connectors:
      - ucm_connector_name: UcmNfsStore
        ucm_connector_config: {storage_backends: "/mnt/a:/mnt/b", storage_policy: tiered}
    ucm_sparse_config: {ESA: {sparse_ratio: 0.3}}
    load_only_first_rank: false

in ``kv_connector_extra_config`` (inline, or a file named by ``ucm_config_path``). It is translated
once, where a connector config is read, into ours (``store``, ``sparse``), with a one-line notice
naming the translation. What cannot be honoured is refused naming the key, why, and what to use
instead: never dropped silently. ``ucm config convert`` prints the translation for a one-time
migration.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ucm.config import ConfigError, load_mapping
from ucm.store.cache import CacheConfig
from ucm.store.factory import REGISTRY
from ucm.store.mooncake import MooncakeConfig
from ucm.store.posix import PosixConfig

logger = logging.getLogger(__name__)

# The top-level keys of UCM's config; any of them makes a connector config UCM-style.
UCM_KEYS = frozenset(
    {"ucm_config_path", "ucm_connectors", "load_only_first_rank", "enable_prefix_cache", "metrics_config_path"}
)
# The short form of UCM's deployment chapter: {"storage_backend": "posix", "storage_path": "/data/kv"}.
FLAT_KEYS = frozenset({"storage_backend", "storage_path", "nfs_path", "enable_distributed"})

# UCM's connector class names; each loads UCMConnector.
CONNECTOR_NAMES = ("UCMConnector", "UCMDirectConnector", "UnifiedCacheConnectorV1")

# UCM's store names (``UcmNfsStore``, ``Nfs``, ``nfs``: the Ucm prefix and Store suffix optional).
STORES = {"nfs": "nfs", "posix": "posix", "pc": "posix", "ds3fs": "ds3fs", "mooncake": "mooncake", "cache": "cache"}
PIPELINE = "pipeline"

FILE_RENAMES = {"storage_backends": "roots", "io_direct": "direct_io", "stream_number": "io_threads"}
MOONCAKE_RENAMES = {"master_server_address": "master_address"}
CACHE_RENAMES = {"cache_size": "capacity"}
REFUSED = {
    "block_size": "tokens per block are vLLM's --block-size here (the connector follows it); remove it",
    "buffer_number": "transfer buffers are sized in bytes by the connector's load_staging; remove it or set that",
    "device": "the device is vLLM's; remove it",
    "device_id": "the device is vLLM's; remove it",
    "unique_id": "blocks are named by content hashes, shared by every engine; nothing to name; remove it",
    "scatter_gather_enable": "loads always go straight into vLLM's KV blocks (no staging copy); remove it",
    "ior_entries": "3FS is used through its FUSE mount here, not USRBIO rings; remove it",
    "ior_depth": "3FS is used through its FUSE mount here, not USRBIO rings; remove it",
    "numa_id": "I/O threads are not pinned; remove it",
    "enable_distributed": "every engine that mounts the store shares it already; remove it",
    "nfs_path": "mount the export and give the mount point as storage_path (or use the resource's store.nfs)",
    "metrics_config_path": "the engine's /metrics exports every ucm_store_* and ucm_sparse_* series; no file to "
    "configure them; remove it",
}


def is_ucm_style(options: Mapping[str, Any]) -> bool:
    return bool((UCM_KEYS | FLAT_KEYS) & set(options))


def translate(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``options`` (a kv_connector_extra_config) with UCM's keys translated into ours; unchanged
    when it holds none. Raises ConfigError naming a key that cannot be honoured."""
    if not is_ucm_style(options):
        return dict(options)
    out = dict(options)
    source = where
    if "ucm_config_path" in out:
        path = out.pop("ucm_config_path")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}.ucm_config_path: expected the path of a ucm_config.yaml")
        source = f"{where}.ucm_config_path: {path}"
        from_file = load_mapping(path, f"{where}.ucm_config_path", "UCM's config mapping (ucm_connectors, ...)")
        for key in from_file:
            if key in out:
                raise ConfigError(f"{source}: {key} is given both in the file and inline; give it once")
        if "ucm_config_path" in from_file:
            raise ConfigError(f"{source}: ucm_config_path inside the file it names")
        out.update(from_file)
    refused = sorted(set(out) & set(REFUSED))
    if refused:
        raise ConfigError(f"{source}: {refused[0]}: not supported: {REFUSED[refused[0]]}")
    store = _store(out, source)
    if store is not None:
        if "store" in out:
            raise ConfigError(f"{source}: give store or UCM's ucm_connectors/storage_backend, not both")
        out["store"] = store
    if out.pop("load_only_first_rank", False) is not False:
        raise ConfigError(
            f"{source}: load_only_first_rank: not supported: each tensor-parallel worker loads its own shard of a "
            "block from the store (no load on rank 0 and broadcast); set it false or remove it"
        )
    if out.pop("enable_prefix_cache", True) is not True:
        raise ConfigError(
            f"{source}: enable_prefix_cache: false is not supported: reusing stored prefixes is what the connector "
            "does; run vLLM without --kv-transfer-config instead"
        )
    # A warning, so it shows wherever the engine logs: the config works, and `ucm config convert` migrates it.
    logger.warning("%s: UCM-style config read as ours (%s); `ucm config convert` prints it", source, _summary(out))
    return out


def _summary(config: Mapping[str, Any]) -> str:
    store = config.get("store") or {}
    parts = [f"store {store.get('spec')!r}"] if store else []
    if "ucm_sparse_config" in config:
        parts.append("ucm_sparse_config")
    return ", ".join(parts) or "no store"


def _store(config: dict[str, Any], where: str) -> dict[str, Any] | None:
    if "ucm_connectors" in config:
        connectors = config.pop("ucm_connectors")
        if not isinstance(connectors, list) or not connectors:
            raise ConfigError(f"{where}: ucm_connectors: expected a list with one store")
        if len(connectors) > 1:
            raise ConfigError(
                f"{where}: ucm_connectors: give one store: UCM used the first whose path was available, which "
                "hides a missing volume; for tiers use storage_policy: tiered or a pipeline (Cache|Posix|Nfs)"
            )
        entry = connectors[0]
        at = f"{where}: ucm_connectors[0]"
        if not isinstance(entry, Mapping) or set(entry) - {"ucm_connector_name", "ucm_connector_config"}:
            raise ConfigError(f"{at}: expected {{ucm_connector_name: ..., ucm_connector_config: {{...}}}}")
        return store_from_ucm(entry.get("ucm_connector_name"), entry.get("ucm_connector_config") or {}, at)
    if "storage_backend" in config or "storage_path" in config:
        backend, path = config.pop("storage_backend", "posix"), config.pop("storage_path", None)
        if path is None:
            raise ConfigError(f"{where}: storage_path: required with storage_backend (the store's directory)")
        return store_from_ucm(backend, {"storage_backends": path}, where)
    return None


def store_name(name: Any, where: str) -> str:
    """Our store for one of UCM's names (``UcmNfsStore``, ``Nfs``, ``pipeline``, ...)."""
    key = name.lower().removeprefix("ucm").removesuffix("store") if isinstance(name, str) else ""
    if key in STORES or key == PIPELINE:
        return STORES.get(key, PIPELINE)
    known = ", ".join(f"Ucm{n.capitalize()}Store" for n in (*STORES, PIPELINE))
    raise ConfigError(f"{where}.ucm_connector_name: unknown store {name!r}; UCM's names here: {known}")


def store_from_ucm(name: Any, options: Any, where: str) -> dict[str, Any]:
    """Our store config for one UCM store entry."""
    kind = store_name(name, where)
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where}.ucm_connector_config: expected a mapping of options")
    at = f"{where}.ucm_connector_config"
    if kind == PIPELINE:
        return _pipeline(options, at)
    if kind == "cache":
        behind = options.get("backend")
        if not isinstance(behind, Mapping) or "name" not in behind:
            raise ConfigError(
                f"{at}.backend: a cache needs the store behind it: {{name: UcmNfsStore, config: {{...}}}}"
            )
        inner = store_from_ucm(behind["name"], behind.get("config") or {}, f"{at}.backend")
        cache = _stage("cache", {k: v for k, v in options.items() if k != "backend"}, at)
        return {**inner, "spec": f"cache|{inner['spec']}", "cache": cache}
    return {"spec": kind, kind: _stage(kind, options, at)}


def _pipeline(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    spec = options.get("pipeline")
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"{where}.pipeline: expected stages front to back, such as 'Cache|Posix|Nfs'")
    stages = [store_name(s.strip(), f"{where}.pipeline") for s in spec.split("|")]
    if PIPELINE in stages:
        raise ConfigError(f"{where}.pipeline: a pipeline inside a pipeline")
    names = [s.strip().lower() for s in spec.split("|")]
    extra = set(options) - {"pipeline", *names}
    if extra:
        raise ConfigError(f"{where}.{sorted(extra)[0]}: not a stage of {spec!r}; options go under one of {names}")
    out: dict[str, Any] = {"spec": "|".join(stages)}
    for name, stage in zip(names, stages, strict=True):
        out[stage] = _stage(stage, options.get(name) or {}, f"{where}.{name}")
    return out


def _stage(kind: str, options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One stage's options: UCM's names translated, ours accepted as they are."""
    model = REGISTRY[kind].config
    renames = {PosixConfig: FILE_RENAMES, MooncakeConfig: MOONCAKE_RENAMES, CacheConfig: CACHE_RENAMES}
    names = next((r for m, r in renames.items() if issubclass(model, m)), {})
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key in REFUSED:
            raise ConfigError(f"{where}.{key}: not supported: {REFUSED[key]}")
        if key == "storage_policy" and issubclass(model, PosixConfig):
            if value not in ("tiered", "round_robin", "random"):
                raise ConfigError(f"{where}.storage_policy: {value!r} is not one of tiered, round_robin, random")
            out["placement"] = value
            continue
        ours = names.get(key, key)
        if ours not in model.model_fields:
            ucm_only = {"storage_policy"} if issubclass(model, PosixConfig) else set()
            accepted = ", ".join(sorted({*names, *ucm_only, *model.model_fields} - set(names.values())))
            raise ConfigError(f"{where}.{key}: unknown option for {kind}; accepted: {accepted}")
        out[ours] = value
    for theirs, ours in names.items():  # a missing required option under the name UCM's users wrote
        field = model.model_fields.get(ours)
        if ours not in out and field is not None and field.is_required():
            raise ConfigError(f"{where}.{theirs}: required ({field.description or ours})")
    roots = out.get("roots")
    if isinstance(roots, str):  # UCM's "/mnt/a:/mnt/b"
        out["roots"] = [r for r in roots.split(":") if r]
    return out
