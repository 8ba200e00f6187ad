"""What the store holds, told through vLLM's KV event publisher (``--kv-events-config``).

vLLM announces the blocks of its own prefix cache; the connector adds the store's, with
``medium: STORAGE``, so that a router following the events (ucm-proxy's ``kv_aware``) knows which
prompt blocks any engine would load rather than compute. They are named by the store's block ids —
the same from every engine — and carry what vLLM's own events carry for a router to key them by:
the tokens, the parent, and the extra keys in vLLM's order: a LoRA adapter's name on every block,
then the ``cache_salt`` on the first.

Announced: the blocks a lookup found (once per request, with the first one it did not find as
removed: the store may have evicted what some engine announced before), and the blocks handed to
workers to save (before the write lands: a router may count on a block for the moment a write
takes, and the engine that gets the request then computes it).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent


class StoreEvents:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pending: list[KVCacheEvent] = []

    def present(
        self,
        ids: Sequence[bytes],
        tokens: Sequence[int],
        start: int,
        end: int,
        lora_name: str | None,
        salt: str | None,
    ) -> None:
        """Blocks ``[start, end)`` of a request whose block ids are ``ids`` and tokens ``tokens``."""
        if end <= start:
            return
        size = self.block_size
        extra = [tuple(key for key in (lora_name, salt if i == 0 else None) if key) or None for i in range(start, end)]
        self._pending.append(
            BlockStored(
                block_hashes=list(ids[start:end]),
                parent_block_hash=ids[start - 1] if start else None,
                token_ids=list(tokens[start * size : end * size]),
                block_size=size,
                lora_id=None,  # vLLM's adapter ids are per engine; routers key by name
                medium=MEDIUM_STORAGE,
                lora_name=lora_name,
                extra_keys=extra if any(extra) else None,
            )
        )

    def missing(self, block_id: bytes) -> None:
        self._pending.append(BlockRemoved(block_hashes=[block_id], medium=MEDIUM_STORAGE))

    def take(self) -> list[KVCacheEvent]:
        out, self._pending = self._pending, []
        return out
