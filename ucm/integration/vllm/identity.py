"""What a model *is*, for block ids: a fingerprint of its weights, not just its name or path; and
which engines can share KV at all (``pairing_identity``).

Two deployments serving different weights under one served name, or weights replaced at the same
path, would otherwise compute identical block ids and load each other's KV — wrong tokens that
every checksum passes. Reading whole checkpoints at startup would cost minutes for large models, so
the fingerprint samples them: the config, then per weight file its name, size, and bytes at fixed
places (its first and last MiB and eight spread 64 KiB windows). A fine-tune changes every tensor,
so samples differ; a copy of the same files at another path fingerprints the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
EDGE = 1 << 20
WINDOW = 64 << 10
WINDOWS = 8


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
    h = hashlib.sha256(b"ucm-weights/v1\0")
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for file in sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        size = file.stat().st_size
        h.update(f"\0{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            for offset, length in _samples(size):
                f.seek(offset)
                h.update(f.read(length))
    return h.hexdigest()[:32]


def _samples(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes read from a file of ``size`` bytes: all of a small one."""
    if size <= 2 * EDGE + WINDOWS * WINDOW:
        return [(0, size)]
    inner = [(EDGE + (size - 2 * EDGE - WINDOW) * i // (WINDOWS - 1), WINDOW) for i in range(WINDOWS)]
    return [(0, EDGE), *inner, (size - EDGE, EDGE)]


# Connector options that change block ids or where blocks live; the others (kv_role, waits, sparse
# attention, modes) may differ between a prefill and its decode.
PAIRING_OPTIONS = ("store", "hash_algorithm", "model_id", "salt")


def pairing_identity(extra_config: Mapping[str, Any], vllm_args: Sequence[str]) -> str:
    """A short digest of what a prefill and a decode must agree on to share KV through the store:
    the model and its revision, dtypes, block size, parallel layout (vLLM's flags; the split of blocks
    in the store, ``store_tp``, rather than the engine's own TP) and the connector's store and
    hashing options, as written — before ``${POD_IP}``-style expansion, so
    every pod of a pool has the same identity. During a rollout that changes any of them, old and
    new engines differ, and the proxy pairs each prefill only with a decode of the same identity
    (``X-UCM-KV-Identity`` on ``/health``): a mismatched pair would make decode wait for blocks
    it can never see, then recompute."""
    flags = argparse.ArgumentParser(add_help=False)
    for names in (
        ("--model",),
        ("--revision",),
        ("--dtype",),
        ("--kv-cache-dtype",),
        ("--block-size",),
        ("--tensor-parallel-size", "-tp"),
        ("--pipeline-parallel-size", "-pp"),
    ):
        flags.add_argument(*names)
    known = vars(flags.parse_known_args([_dashed(a) for a in vllm_args])[0])
    if extra_config.get("store_tp") is not None:  # blocks are split in the store by it, not by the engine's TP
        known["tensor_parallel_size"] = str(extra_config["store_tp"])
    what = {"vllm": known, "connector": {k: extra_config.get(k) for k in PAIRING_OPTIONS}}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _dashed(arg: str) -> str:
    """``--flag_name[=value]`` as vLLM reads it: ``--flag-name[=value]``."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value
