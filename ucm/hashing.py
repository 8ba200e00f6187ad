"""Chained, content-addressed ids for full KV blocks.

Block ``i``'s id is ``H(parent || tokens of block i)`` where ``parent`` is block ``i-1``'s id and,
for block 0, a seed (:class:`HashContext`). The rule: **an id names everything that changes its
block's KV bytes, given its tokens** — so two blocks share an id only when they hold the same
bytes, and what cannot be named stays out of the store. An id names the whole prefix that produced
it, under one model layout, for one tenant, one adapter.

What goes into the seed (the connector reads each from vLLM's config and request in
``ucm.integration.vllm.identity``; ``docs/concepts/hashing.md`` lists every input vLLM 0.32 lets an
engine or a request change, with its decision):

- per engine: the model's identity and a fingerprint of its weights (``model``, ``weights``); the KV
  dtype, block size, tensor- and pipeline-parallel layout; every setting that changes activations
  beyond the checkpoint (``engine``: ``--hf-overrides``, ``--quantization``, ``--hf-config-path``,
  ``--disable-sliding-window``…); the deployment's salt;
- per request: its ``cache_salt`` (``request_salt``), its LoRA adapter by content (``adapter``: a
  fingerprint of the adapter's files and the engine's LoRA settings, never its name alone), and
  Blend's settings for blended KV (``blend``). Requests whose KV their tokens do not name —
  multimodal inputs, prompt embeddings, an adapter whose files cannot be fingerprinted — never
  reach the store.

Fields added after the first release are left out of the seed while empty, so the ids of engines
and requests that do not use them are the ids they always were.

Every process that must agree (scheduler, workers, prefill, decode, admin tools) calls
:class:`BlockHasher`; nothing depends on Python's ``hash()`` or on process state.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

logger = logging.getLogger(__name__)

HashAlgorithm = Literal["sha256", "blake3", "md5"]
HASH_ALGORITHMS: tuple[str, ...] = ("sha256", "blake3", "md5")

# Token ids are hashed as little-endian uint32: every tokenizer vocabulary fits, and a fixed
# width makes the byte string unambiguous (no separators needed).
_TOKEN_MAX = 2**32 - 1
_LITTLE_ENDIAN = array("I", [1]).tobytes()[0] == 1
# Seed fields left out while empty: added after ids were first stored, they must not change the ids
# of engines and requests that do not use them.
OPTIONAL_FIELDS = ("request_salt", "blend", "engine", "adapter")


def _digest_fn(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    if algorithm == "md5":
        return lambda data: hashlib.md5(data, usedforsecurity=False).digest()
    if algorithm == "blake3":
        try:
            from blake3 import blake3
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError("hash_algorithm: 'blake3' needs the blake3 package (pip install 'ucm[blake3]')") from exc
        return lambda data: blake3(data).digest()
    raise ValueError(f"hash_algorithm: {algorithm!r} is not one of {', '.join(HASH_ALGORITHMS)}")


@dataclass(frozen=True)
class HashContext:
    """Everything besides the tokens that a block id must depend on."""

    model: str
    dtype: str
    block_size: int
    tp_size: int = 1
    salt: str = ""
    request_salt: str = ""  # a request's cache_salt: its own field, so "acme" + "-prod" != "acme-prod"
    algorithm: HashAlgorithm = "sha256"
    weights: str = ""  # a fingerprint of the weights (ucm.integration.vllm.identity): same name, other weights
    pp_size: int = 1  # pipeline stages: each holds other layers, so the layout differs
    # KV not made by a plain prefill: Blend's settings (ucm.integration.vllm.blend). Its own field, so
    # that no salt a client picks can name blended blocks as exact ones.
    blend: str = ""
    # What the engine changes beyond its checkpoint (identity.engine_identity): overrides, quantization.
    engine: str = ""
    # The request's LoRA adapter, by content (identity.Adapters): a name may mean other weights.
    adapter: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must be a non-empty model identity (name or path)")
        if not self.dtype:
            raise ValueError("dtype: must be a non-empty dtype name such as 'float16'")
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be a positive number of tokens, got {self.block_size}")
        if self.tp_size <= 0:
            raise ValueError(f"tp_size: must be a positive integer, got {self.tp_size}")
        if self.pp_size <= 0:
            raise ValueError(f"pp_size: must be a positive integer, got {self.pp_size}")
        _digest_fn(self.algorithm)  # validates the name (and blake3's availability) early

    def for_request(self, request_salt: str = "", blend: str = "", adapter: str = "") -> HashContext:
        """This engine's context for one request's own inputs."""
        return replace(self, request_salt=request_salt, blend=blend, adapter=adapter)


class BlockHasher:
    """Computes chained block ids for one :class:`HashContext`.

    ``block_ids(tokens)`` hashes every full block; ``extend(tokens, known)`` hashes only the blocks
    past ``known`` (ids computed earlier for a prefix of the same tokens), so a request's ids are
    computed once however many times a scheduler asks.
    """

    def __init__(self, context: HashContext) -> None:
        self.context = context
        self._digest = _digest_fn(context.algorithm)
        if context.algorithm == "md5":
            logger.warning(
                "hash_algorithm=md5: ids are not collision resistant; crafted prompts could make one "
                "tenant's blocks collide with another's. Use it only for trusted single-tenant setups."
            )
        fields = asdict(context)
        for name in OPTIONAL_FIELDS:  # ids stay what they were before these fields, when unset
            if not fields[name]:
                del fields[name]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        self.seed: bytes = self._digest(b"ucm-block-seed/v1\x00" + canonical.encode())

    @property
    def block_size(self) -> int:
        return self.context.block_size

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.context.block_size

    def block_ids(self, tokens: Sequence[int]) -> list[bytes]:
        return self.extend(tokens, [])

    def extend(self, tokens: Sequence[int], known: Sequence[bytes]) -> list[bytes]:
        """Ids of every full block of ``tokens``, reusing ``known`` ids of its leading blocks."""
        bs = self.context.block_size
        n_full = len(tokens) // bs
        if len(known) > n_full:
            raise ValueError(f"known: {len(known)} ids given for only {n_full} full blocks")
        ids = list(known)
        parent = ids[-1] if ids else self.seed
        if len(ids) == n_full:
            return ids
        packed = _pack_tokens(tokens[len(ids) * bs : n_full * bs])
        width = bs * 4
        for i in range(n_full - len(ids)):
            parent = self._digest(parent + packed[i * width : (i + 1) * width])
            ids.append(parent)
        return ids


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"tokens: every token id must be an integer in [0, {_TOKEN_MAX}]") from exc
    if not _LITTLE_ENDIAN:  # pragma: no cover - no big-endian CI
        packed.byteswap()
    return packed.tobytes()
