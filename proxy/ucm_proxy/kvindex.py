"""Which engine holds which KV blocks, from the engines' own KV events (vLLM ``--kv-events-config``).

vLLM announces every block its prefix cache gains (``BlockStored``: the block's hash, its parent's,
its tokens and the extra keys its hash covered — LoRA, media, ``cache_salt``) and loses
(``BlockRemoved``, ``AllBlocksCleared``). Its own hashes cannot be recomputed here: they start from
a per-process random seed unless ``PYTHONHASHSEED`` is pinned. So this index keys blocks by a chain
of its own over the same inputs — parent's key, extra keys, tokens — which a request's tokens and
``cache_salt`` give too: a tenant's prompt matches only blocks stored under its own salt, as in the
engine. Each engine's vLLM hashes map to these keys, so removals and parents resolve.

An engine's entries are bounded (``max_blocks``, the oldest announced go first) and cleared whenever
its stream cannot be trusted (a lost batch, a restart): the index may then miss blocks an engine
holds, never claim ones it dropped for longer than its events take to arrive.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterable, Sequence
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


def decode_batch(payload: bytes) -> EventBatch:
    """One batch from the wire; ``msgspec.ValidationError`` / ``DecodeError`` if it is not one."""
    return _decode(payload)


def block_key(parent: bytes, extra: Sequence[Any] | None, tokens: Sequence[int]) -> bytes:
    """This index's key of a block: its parent's key, the extra keys its hash covers, its tokens."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(json.dumps(list(extra), separators=(",", ":")).encode() if extra else b"-")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def request_keys(tokens: Sequence[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    """The keys of a prompt's full blocks, as an engine serving it with ``cache_salt`` would announce
    them (vLLM adds the salt to the first block's extra keys only)."""
    keys: list[bytes] = []
    parent = b""
    for i in range(len(tokens) // block_size):
        extra = [cache_salt] if i == 0 and cache_salt else None
        parent = block_key(parent, extra, tokens[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys


class EngineBlocks:
    """One engine's announced blocks."""

    def __init__(self, url: str, max_blocks: int) -> None:
        self.url = url
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        self._by_vllm: dict[VLLMHash, bytes] = {}  # insertion order: the oldest announced first
        self._held: dict[bytes, VLLMHash] = {}
        self._gauge = metrics.KV_INDEX_BLOCKS.labels(url)

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._by_vllm.clear()
        self._held.clear()
        self._gauge.set(0)

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                if event.medium in _ENGINE_MEDIA and event.group_idx in (None, 0):
                    for h in event.block_hashes:
                        self._forget(h)
                metrics.child(metrics.KV_EVENTS, "removed").inc()
            else:
                self.clear()
                metrics.child(metrics.KV_EVENTS, "cleared").inc()
        self._gauge.set(len(self._held))

    def _stored(self, event: BlockStored) -> None:
        n, size = len(event.block_hashes), event.block_size
        extras = event.extra_keys
        if size <= 0 or len(event.token_ids) != n * size or (extras is not None and len(extras) != n):
            metrics.child(metrics.KV_EVENTS, "malformed").inc()
            return
        # Hybrid models announce each KV cache group; the first (full attention) decides prefixes.
        if event.medium not in _ENGINE_MEDIA or event.group_idx not in (None, 0):
            metrics.child(metrics.KV_EVENTS, "other_tier").inc()
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
            parent = block_key(parent, extras[i] if extras else None, event.token_ids[i * size : (i + 1) * size])
            self._forget(vllm_hash)
            self._by_vllm[vllm_hash] = parent
            self._held[parent] = vllm_hash
        while len(self._by_vllm) > self.max_blocks:
            self._forget(next(iter(self._by_vllm)))
        metrics.child(metrics.KV_EVENTS, "stored").inc()

    def _forget(self, vllm_hash: VLLMHash) -> None:
        key = self._by_vllm.pop(vllm_hash, None)
        if key is not None and self._held.get(key) == vllm_hash:
            del self._held[key]

    def prefix_blocks(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, this engine holds."""
        for i, key in enumerate(keys):
            if key not in self._held:
                return i
        return len(keys)


class BlockIndex:
    """Every followed engine's blocks, by backend URL."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.engines: dict[str, EngineBlocks] = {}

    def engine(self, url: str) -> EngineBlocks:
        if url not in self.engines:
            self.engines[url] = EngineBlocks(url, self.max_blocks)
        return self.engines[url]

    def forget(self, url: str) -> None:
        self.engines.pop(url, None)  # its gauge goes with the backend's other series (metrics.forget_backend)

    def known(self, urls: Iterable[str]) -> list[EngineBlocks]:
        """The engines among ``urls`` that hold anything (and so have announced their block size)."""
        return [e for u in urls if (e := self.engines.get(u)) is not None and len(e) and e.block_size]

    def hit_tokens(
        self, engines: Iterable[EngineBlocks], tokens: Sequence[int], cache_salt: str | None
    ) -> dict[str, int]:
        """Prompt tokens each engine holds as a cached prefix."""
        keys: dict[int, list[bytes]] = {}
        hits: dict[str, int] = {}
        for e in engines:
            assert e.block_size is not None
            if e.block_size not in keys:
                keys[e.block_size] = request_keys(tokens, e.block_size, cache_salt)
            hits[e.url] = e.prefix_blocks(keys[e.block_size]) * e.block_size
        return hits
