"""Which engine holds which KV blocks, from the engines' own KV events (vLLM ``--kv-events-config``).

vLLM announces every block its prefix cache gains (``BlockStored``: the block's hash, its parent's,
its tokens, the LoRA adapter that computed it and the extra keys its hash covered — the adapter's
name, media, ``cache_salt``) and loses (``BlockRemoved``, ``AllBlocksCleared``). Its own hashes
cannot be recomputed here: they start from a per-process random seed unless ``PYTHONHASHSEED`` is
pinned. So this index keys blocks by a chain of its own over the same inputs — parent's key,
adapter, extra keys, tokens — which a request's tokens, adapter and ``cache_salt`` give too: a
tenant's prompt matches only blocks stored under its own salt, an adapter's only blocks its adapter
computed, a base model's prompt no adapter's blocks, as in the engine. Each engine's vLLM hashes map
to these keys, so removals and parents resolve.

An engine's entries are bounded (``max_blocks``, the oldest announced go first) and cleared whenever
its stream cannot be trusted (a lost batch, a restart): the index may then miss blocks an engine
holds, never claim ones it dropped for longer than its events take to arrive. The shared store is
one more tier, fed by every engine's stream: the UCM connector announces its blocks with
``medium: STORAGE`` under the store's own block ids, which are the same from every engine.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from ucm_proxy import metrics

VLLMHash = bytes | int  # sha256 digests, or 64-bit ints under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES


# The wire format of vLLM's KVEventBatch (msgpack): fields this index does not read are ignored.
class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[VLLMHash]
    parent_block_hash: VLLMHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[VLLMHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decode = msgspec.msgpack.Decoder(EventBatch).decode
# The engine's own cache: vLLM names it GPU on every device (its CPU build too); CPU offloading and
# storage tiers are other media, not what this engine's prefix cache holds.
_ENGINE_MEDIA = (None, "GPU")
STORAGE = "STORAGE"  # what UCMConnector announces for the shared store


def decode_batch(payload: bytes) -> EventBatch:
    """One batch from the wire; ``msgspec.ValidationError`` / ``DecodeError`` if it is not one."""
    return _decode(payload)


def block_key(parent: bytes, lora_name: str | None, extra: Sequence[Any] | None, tokens: Sequence[int]) -> bytes:
    """This index's key of a block: its parent's key, its adapter, the extra keys its hash covers,
    its tokens. (The extra keys are untagged: the adapter apart keeps a base block salted with an
    adapter's name from matching that adapter's first block.)"""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(json.dumps([lora_name, list(extra) if extra else None], separators=(",", ":")).encode())
    h.update(array("q", tokens).tobytes())
    return h.digest()


def request_keys(
    tokens: Sequence[int], block_size: int, cache_salt: str | None, lora_name: str | None = None
) -> list[bytes]:
    """The keys of a prompt's full blocks, as an engine serving it with ``cache_salt`` and the LoRA
    adapter ``lora_name`` would announce them (vLLM puts the adapter's name first in every block's
    extra keys, the salt after it in the first block's only)."""
    keys: list[bytes] = []
    parent = b""
    adapter = [lora_name] if lora_name else []
    for i in range(len(tokens) // block_size):
        extra = [*adapter, cache_salt] if i == 0 and cache_salt else adapter
        parent = block_key(parent, lora_name or None, extra, tokens[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys


class Blocks:
    """Blocks announced in one tier: an engine's own cache, or the shared store."""

    def __init__(self, name: str, max_blocks: int) -> None:
        self.name = name
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        self._by_vllm: dict[VLLMHash, bytes] = {}  # insertion order: the oldest announced first
        self._held: dict[bytes, VLLMHash] = {}
        self._gauge = metrics.KV_INDEX_BLOCKS.labels(name)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: bytes) -> bool:
        return key in self._held

    def clear(self) -> None:
        self._by_vllm.clear()
        self._held.clear()
        self._gauge.set(0)

    def stored(self, event: BlockStored) -> None:
        n, size = len(event.block_hashes), event.block_size
        extras = event.extra_keys
        if size <= 0 or len(event.token_ids) != n * size or (extras is not None and len(extras) != n):
            metrics.child(metrics.KV_EVENTS, "malformed").inc()
            return
        if event.parent_block_hash is None:
            parent = b""
        elif (found := self._by_vllm.get(event.parent_block_hash)) is not None:
            parent = found
        else:  # its parent was announced before this index listened (or dropped since)
            metrics.child(metrics.KV_EVENTS, "orphan").inc()
            return
        self.block_size = size
        for i, vllm_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * size : (i + 1) * size]
            parent = block_key(parent, event.lora_name or None, extras[i] if extras else None, tokens)
            self.forget(vllm_hash)
            self._by_vllm[vllm_hash] = parent
            self._held[parent] = vllm_hash
        while len(self._by_vllm) > self.max_blocks:
            self.forget(next(iter(self._by_vllm)))
        self._gauge.set(len(self._held))
        metrics.child(metrics.KV_EVENTS, "stored").inc()

    def removed(self, event: BlockRemoved) -> None:
        for h in event.block_hashes:
            self.forget(h)
        self._gauge.set(len(self._held))
        metrics.child(metrics.KV_EVENTS, "removed").inc()

    def forget(self, vllm_hash: VLLMHash) -> None:
        key = self._by_vllm.pop(vllm_hash, None)
        if key is not None and self._held.get(key) == vllm_hash:
            del self._held[key]


def prefix_blocks(keys: Sequence[bytes], *tiers: Blocks) -> int:
    """How many of ``keys``, from the first, some of ``tiers`` holds."""
    for i, key in enumerate(keys):
        if not any(key in tier for tier in tiers):
            return i
    return len(keys)


class BlockIndex:
    """Every followed engine's own blocks by backend URL, and the shared store's: what the UCM
    connector of any engine announced (``medium: STORAGE``) under the store's own block ids, which
    are the same from every engine."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.engines: dict[str, Blocks] = {}
        self.store = Blocks("store", max_blocks)

    def engine(self, url: str) -> Blocks:
        if url not in self.engines:
            self.engines[url] = Blocks(url, self.max_blocks)
        return self.engines[url]

    def forget(self, url: str) -> None:
        self.engines.pop(url, None)  # its gauge goes with the backend's other series (metrics.forget_backend)

    def apply(self, url: str, batch: EventBatch) -> None:
        """One batch of the engine at ``url``."""
        engine = self.engine(url)
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):  # the engine's cache; the store keeps its blocks
                engine.clear()
                metrics.child(metrics.KV_EVENTS, "cleared").inc()
                continue
            tier = self.store if event.medium == STORAGE else engine if event.medium in _ENGINE_MEDIA else None
            # Hybrid models announce each KV cache group; the first (full attention) decides prefixes.
            if tier is None or event.group_idx not in (None, 0):
                metrics.child(metrics.KV_EVENTS, "other_tier").inc()
            elif isinstance(event, BlockStored):
                tier.stored(event)
            else:
                tier.removed(event)

    def knows(self, urls: Sequence[str]) -> bool:
        """Whether the store or an engine among ``urls`` has announced any block."""
        return bool(len(self.store)) or any(len(e) for u in urls if (e := self.engines.get(u)) is not None)

    def cached(
        self, urls: Sequence[str], tokens: Sequence[int], cache_salt: str | None, lora_name: str | None = None
    ) -> dict[str, tuple[int, int]]:
        """Per engine among ``urls``: the prompt's tokens (run with the LoRA adapter ``lora_name``,
        None: the base model) its own cache holds as a prefix, and those its cache and the store
        together hold (it loads the rest of that prefix). Empty when nothing is known (``knows``)."""
        if not self.knows(urls):
            return {}
        keys: dict[int, list[bytes]] = {}
        out: dict[str, tuple[int, int]] = {}
        for url in urls:
            engine = self.engines.get(url)
            size = (engine.block_size if engine is not None else None) or self.store.block_size
            if size is None:
                continue
            if size not in keys:
                keys[size] = request_keys(tokens, size, cache_salt, lora_name)
            own = prefix_blocks(keys[size], engine) if engine is not None else 0
            out[url] = (own * size, prefix_blocks(keys[size], *(t for t in (engine, self.store) if t)) * size)
        return out
