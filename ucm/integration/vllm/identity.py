"""What a model *is*, for block ids: a fingerprint of its weights, not just its name or path; what
an engine changes beyond them (``engine_identity``); a request's LoRA adapter, by content
(:class:`Adapters`); and which engines can share KV at all (``pairing_identity``).

Two deployments serving different weights under one served name, or weights replaced at the same
path, would otherwise compute identical block ids and load each other's KV — wrong tokens that
every checksum passes. Reading whole checkpoints at startup would cost minutes for large models, so
the fingerprint samples them: the config, then per weight file its name, size, and bytes at fixed
places (its first and last MiB and eight spread 64 KiB windows). A fine-tune changes every tensor,
so samples differ; a copy of the same files at another path fingerprints the same. Adapters are
fingerprinted the same way (they are small: mostly read whole).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from ucm.config import ConfigError
from ucm.integration.vllm.config import BLEND_ARCHITECTURE

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
EDGE = 1 << 20
WINDOW = 64 << 10
WINDOWS = 8
ADAPTER_CONFIG = "adapter_config.json"


def weights_fingerprint(model: str, revision: str | None = None) -> str:
    """A short hex digest of a local model directory's weights; for a hub id, the id's revision."""
    path = Path(model)
    if not path.is_dir():
        if revision is None:
            logger.warning(
                "model %s: no local directory and no pinned revision; block ids cannot tell two "
                "versions of it apart (pin --revision, or serve from a directory)",
                model,
            )
        return f"revision:{revision or 'unpinned'}"
    return _directory_fingerprint(path, "config.json", b"ucm-weights/v1\0")


def _directory_fingerprint(path: Path, config: str, domain: bytes) -> str:
    """The config file's bytes, then per weight file its name, size and sampled bytes."""
    h = hashlib.sha256(domain)
    if (path / config).is_file():
        h.update((path / config).read_bytes())
    for file in _weight_files(path):
        size = file.stat().st_size
        h.update(f"\0{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            for offset, length in _samples(size):
                f.seek(offset)
                h.update(f.read(length))
    return h.hexdigest()[:32]


def _weight_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _samples(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes read from a file of ``size`` bytes: all of a small one."""
    if size <= 2 * EDGE + WINDOWS * WINDOW:
        return [(0, size)]
    inner = [(EDGE + (size - 2 * EDGE - WINDOW) * i // (WINDOWS - 1), WINDOW) for i in range(WINDOWS)]
    return [(0, EDGE), *inner, (size - EDGE, EDGE)]


def engine_identity(model: Any, cache: Any) -> str:
    """What this engine changes in a block's KV beyond its checkpoint, KV dtype and layout, as a
    short digest (``HashContext.engine``); "" when it changes nothing, so a plain engine's ids stay
    what they were. ``model`` and ``cache`` are vLLM's ModelConfig and CacheConfig.

    Left out, because they leave the KV of given tokens as it is: the served name, the tokenizer
    (it changes tokens, which ids hash anyway), ``--model-impl`` (the same layers), limits and
    scheduling. UCM's own Blend model class (an ``architectures`` override) computes what vLLM's
    Llama computes, so an engine that blends names its exact blocks as one that does not."""
    what: dict[str, Any] = {}
    overrides = _named_overrides(model.hf_overrides)
    if overrides:
        what["hf_overrides"] = overrides
    if model.quantization:  # on-the-fly quantization (a quantized checkpoint's is in its config too)
        what["quantization"] = str(model.quantization)
    if model.quantization_config:
        what["quantization_config"] = _canonical(model.quantization_config, "quantization_config")
    if model.hf_config_path:
        config_path = Path(model.hf_config_path)
        what["hf_config"] = (
            _directory_fingerprint(config_path, "config.json", b"ucm-config/v1\0")
            if config_path.is_dir()
            else str(model.hf_config_path)
        )
    if getattr(model, "model_weights", ""):  # weights read from elsewhere than the model's directory
        what["model_weights"] = weights_fingerprint(model.model_weights, model.revision)
    if model.code_revision:
        what["code_revision"] = model.code_revision
    if model.disable_sliding_window:
        what["disable_sliding_window"] = True
    if model.model_class_overrides:
        what["model_class_overrides"] = _canonical(model.model_class_overrides, "model_class_overrides")
    if cache.kv_cache_dtype_skip_layers:  # some layers' KV unquantized: another layout
        what["kv_cache_dtype_skip_layers"] = sorted(cache.kv_cache_dtype_skip_layers)
    if not what:
        return ""
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _named_overrides(overrides: Any) -> dict[str, Any]:
    if callable(overrides):
        raise ConfigError(
            "hf_overrides: a function cannot be named in block ids; give the overrides as a JSON object "
            "(--hf-overrides '{...}')"
        )
    named = dict(overrides or {})
    if named.get("architectures") == [BLEND_ARCHITECTURE]:
        del named["architectures"]
    return json.loads(_canonical(named, "hf_overrides")) if named else {}


def _canonical(value: Any, field: str) -> str:
    """``value`` as canonical JSON: a setting is named by what it says, not by how it was written."""

    def plain(item: Any) -> Any:
        if hasattr(item, "model_dump"):
            return item.model_dump(mode="json")
        if is_dataclass(item) and not isinstance(item, type):
            return asdict(item)
        text = str(item)
        if " at 0x" in text:  # an object named by its address: nothing another engine can agree on
            raise ConfigError(f"{field}: {text} cannot be named in block ids; give plain JSON values")
        return text

    return json.dumps(value, sort_keys=True, default=plain)


@dataclass
class _Adapter:
    path: str
    signature: tuple[tuple[str, int, int, int], ...]
    identity: str | None  # None: its KV cannot be named (kept out of the store)


class Adapters:
    """A LoRA adapter's identity for block ids: a fingerprint of its files (config and weights) and
    of the engine's LoRA settings that change what it computes (``lora_dtype``, target modules) —
    never its name alone, which a reload (``/v1/load_lora_adapter``) or another deployment may
    point at other weights.

    vLLM's workers load an adapter by its integer id, once, from its path. So an adapter is
    fingerprinted at its first request, and from then on it is named only while it is what the
    workers loaded: if its id comes back with another path, or its files change in place (another
    size, mtime or inode), nobody can say which weights the workers hold, and its requests stay out
    of the store for the rest of the engine's life (logged once). An adapter given by a hub id
    rather than a directory cannot be fingerprinted here and stays out too."""

    def __init__(self, lora_config: Any | None) -> None:
        settings = {}
        if lora_config is not None:
            settings = {
                "lora_dtype": str(lora_config.lora_dtype).removeprefix("torch."),
                "target_modules": sorted(lora_config.target_modules or []),
            }
        self._settings = json.dumps(settings, sort_keys=True).encode()
        self._known: dict[int, _Adapter] = {}

    def identity(self, lora_request: Any) -> str | None:
        """The adapter's identity, or None when its KV cannot be named."""
        adapter_id, path = lora_request.lora_int_id, str(lora_request.lora_path)
        known = self._known.get(adapter_id)
        signature = _signature(Path(path))
        if known is None:
            identity = None
            if signature:
                digest = hashlib.sha256(self._settings)
                digest.update(_directory_fingerprint(Path(path), ADAPTER_CONFIG, b"ucm-adapter/v1\0").encode())
                identity = digest.hexdigest()[:32]
            else:
                logger.warning(
                    "LoRA adapter %s (%s): not a directory holding %s; its requests stay out of the store",
                    lora_request.lora_name,
                    path,
                    ADAPTER_CONFIG,
                )
            self._known[adapter_id] = _Adapter(path, signature, identity)
            return identity
        if known.identity is not None and (known.path != path or known.signature != signature):
            logger.warning(
                "LoRA adapter %s: %s since the engine first loaded it; which weights the workers hold "
                "cannot be told, so its requests stay out of the store until the engine restarts",
                lora_request.lora_name,
                f"its path changed from {known.path} to {path}" if known.path != path else f"{path} changed",
            )
            known.identity = None
        return known.identity


def _signature(path: Path) -> tuple[tuple[str, int, int, int], ...]:
    """(name, size, mtime, inode) of an adapter's config and weight files; () if it is no adapter
    directory."""
    try:
        if not (path / ADAPTER_CONFIG).is_file():
            return ()
        files = [path / ADAPTER_CONFIG, *_weight_files(path)]
        return tuple((f.name, (st := os.stat(f)).st_size, st.st_mtime_ns, st.st_ino) for f in files)
    except OSError:
        return ()


# Connector options that change block ids or where blocks live; the others (kv_role, waits, sparse
# attention, modes) may differ between a prefill and its decode.
PAIRING_OPTIONS = ("store", "hash_algorithm", "model_id", "salt")


def pairing_identity(extra_config: Mapping[str, Any], vllm_args: Sequence[str]) -> str:
    """A short digest of what a prefill and a decode must agree on to share KV through the store:
    the model and its revision, dtypes, block size, parallel layout (vLLM's flags; the split of blocks
    in the store, ``store_tp``, rather than the engine's own TP), what changes activations beyond the
    checkpoint (``engine_identity``'s flags), the adapters served and their settings (a decode must
    serve every adapter its prefill does), and the connector's store and hashing options, as written
    — before ``${POD_IP}``-style expansion, so every pod of a pool has the same identity. During a
    rollout that changes any of them, old and new engines differ, and the proxy pairs each prefill
    only with a decode of the same identity (``X-UCM-KV-Identity`` on ``/health``): a mismatched pair
    would make decode wait for blocks it can never see, then recompute."""
    flags = argparse.ArgumentParser(add_help=False)
    for names in (
        ("--model",),
        ("--revision",),
        ("--dtype",),
        ("--kv-cache-dtype",),
        ("--kv-cache-dtype-skip-layers",),
        ("--block-size",),
        ("--tensor-parallel-size", "-tp"),
        ("--pipeline-parallel-size", "-pp"),
        ("--hf-overrides",),
        ("--quantization", "-q"),
        ("--quantization-config",),
        ("--hf-config-path",),
        ("--code-revision",),
        ("--lora-dtype",),
    ):
        flags.add_argument(*names)
    for names in (("--lora-modules",), ("--lora-target-modules",)):
        flags.add_argument(*names, nargs="+")
    for name in ("--enable-lora", "--disable-sliding-window"):
        flags.add_argument(name, action="store_true")
    known = vars(flags.parse_known_args([_dashed(a) for a in vllm_args])[0])
    if known["hf_overrides"] is not None:
        known["hf_overrides"] = _written_overrides(known["hf_overrides"])
    if extra_config.get("store_tp") is not None:  # blocks are split in the store by it, not by the engine's TP
        known["tensor_parallel_size"] = str(extra_config["store_tp"])
    what = {"vllm": known, "connector": {k: extra_config.get(k) for k in PAIRING_OPTIONS}}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _written_overrides(text: str) -> Any:
    """``--hf-overrides`` as JSON says it (key order and spacing aside), without Blend's class."""
    try:
        return _named_overrides(json.loads(text)) or None
    except (ValueError, TypeError, AttributeError):
        return text  # vLLM refuses it at start; the identity need only differ


def _dashed(arg: str) -> str:
    """``--flag_name[=value]`` as vLLM reads it: ``--flag-name[=value]``."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value
