"""``ucm config convert FILE``: a UCM-style config as ours, to migrate once.

FILE is UCM's ``ucm_config.yaml`` (``ucm_connectors``, ``ucm_sparse_config``, ...) or a
kv-transfer-config (JSON or YAML) whose ``kv_connector_extra_config`` holds UCM's keys. The
output is either the kv-transfer-config ``ucm serve --kv-config`` takes, or the ``spec.store`` /
``spec.sparse`` fragment of a UCMDeployment, with comments naming what the resource cannot say.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ucm.config import ConfigError, load_mapping
from ucm.deploy.spec import FILE_KINDS, BlendSpec, SparseSpec
from ucm.integration.vllm.config import ConnectorConfig, parse_connector_config
from ucm.serve import native_kv_config
from ucm.sparse.config import parse_sparse_config
from ucm.store.factory import parse_spec

# Our file store options as a resource's store.files fields.
FILES_FIELDS = {
    "io_threads": "ioThreads",
    "direct_io": "directIO",
    "fsync": "fsync",
    "capacity": "capacity",
    "evict_to": "evictTo",
    "verify_checksum": "verifyChecksum",
}
MOONCAKE_FIELDS = {
    "master_address": "address",
    "metadata_server": "metadataServer",
    "protocol": "protocol",
    "device_name": "deviceName",
    "global_segment_size": "segmentSize",
}


def kv_transfer_config(path: str | Path, need_store: bool = True) -> dict[str, Any]:
    """The file as the kv-transfer-config ``ucm serve`` takes, UCM's keys translated.
    ``need_store=False`` accepts a file without a store (a sparse section alone)."""
    data = load_mapping(path, "ucm config convert", "a ucm_config.yaml or a kv-transfer-config")
    if "kv_connector_extra_config" not in data:
        data = {"kv_connector_extra_config": data}  # a ucm_config.yaml: the extra config itself
    if not isinstance(data["kv_connector_extra_config"], dict):
        raise ConfigError(f"{path}: kv_connector_extra_config: expected a mapping")
    config = {"kv_role": "kv_both", **native_kv_config(data, path)}
    native = config["kv_connector_extra_config"]
    if "store" not in native and not set(native) - set(ConnectorConfig.model_fields):
        if need_store:
            raise ConfigError(
                f"{path}: ucm_connectors: required: the store the connector saves blocks to and loads them from "
                "(for a resource fragment of the sparse section alone: --to resource)"
            )
        if "sparse" in native:
            parse_sparse_config(native["sparse"], "sparse")
    else:
        parse_connector_config(native)
    return config


def resource_fragment(native: dict[str, Any]) -> str:
    """``spec.store``, ``spec.sparse`` and ``spec.blend`` of a UCMDeployment for a native connector config, as YAML;
    comments name what a resource's store (one volume every engine mounts) cannot say."""
    notes: list[str] = []
    spec: dict[str, Any] = {}
    store = native.get("store")
    if store:
        stages = parse_spec(store["spec"])
        kind, options = stages[-1], store.get(stages[-1]) or {}
        out: dict[str, Any] = {"type": kind}
        for front in stages[:-1]:
            if front == "cache":
                out["cacheSize"] = store["cache"]["capacity"]
            else:
                notes.append(f"store: a {front} tier in front of {kind} (a pipeline) is not in the resource yet")
        if kind in FILE_KINDS:
            files = {FILES_FIELDS[k]: v for k, v in options.items() if k in FILES_FIELDS}
            if files:
                out["files"] = files
            if options.get("placement", "hash") != "hash":
                notes.append(f"store: placement {options['placement']} is not in the resource yet (one volume)")
            if options.get("mac_key_file"):
                notes.append("store: mac_key_file becomes store.mac: true (the deployment generates the key)")
            notes.append(
                f"store.{kind}: the volume every engine mounts (docs: concepts/resource.md); "
                f"UCM's storage_backends were {', '.join(options.get('roots', []))}"
            )
        elif kind == "mooncake":
            out["mooncake"] = {MOONCAKE_FIELDS[k]: v for k, v in options.items() if k in MOONCAKE_FIELDS}
        spec["store"] = out
    for section, model in (("sparse", SparseSpec), ("blend", BlendSpec)):  # the resource spells them camelCase
        if native.get(section) is not None:
            spec[section] = model.model_validate(native[section]).model_dump(
                mode="json", by_alias=True, exclude_unset=True
            )
    text = yaml.safe_dump({"spec": spec}, sort_keys=False) if spec else "spec: {}\n"
    return "".join(f"# {n}\n" for n in notes) + text


def convert(path: str | Path, to: str) -> str:
    config = kv_transfer_config(path, need_store=to == "kv-config")
    if to == "kv-config":
        return json.dumps(config, indent=2)
    return resource_fragment(config["kv_connector_extra_config"])
