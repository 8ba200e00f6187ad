"""GSA: windowed top-k selection plus a prefetch engine that makes selected blocks resident early.

Selection scores blocks by the same upper bound PSA uses (``q . k`` bounded by each block's key
extremes), so a block with one very relevant token is not averaged away. The prefetch engine
loads blocks from a UCM store (:mod:`ucm.store`) into a fixed set of staging slots on a
background thread, most urgent first (a priority queue); attention then asks for the blocks it
selected, and each one is a hit (already resident) or a miss (loaded on the spot).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ucm.sparse.base import BlockMeta, BlockSelector, PagedKV
from ucm.sparse.options import GSAConfig
from ucm.sparse.psa import upper_bounds
from ucm.store import Store


class GSA(BlockSelector):
    def __init__(self, config: GSAConfig | None = None, shared: bool = False) -> None:
        self.config = config or GSAConfig()
        self.shared = shared

    def select(self, q: torch.Tensor, kv: PagedKV, meta: BlockMeta, step: int = 0) -> torch.Tensor:
        meta.update(kv)
        return self.config.choose(upper_bounds(q, meta).amax(1), kv.block_size, self.shared)


class PrefetchEngine:
    """Blocks from a store into ``slots`` staging buffers of ``block_bytes``, most urgent first."""

    def __init__(self, store: Store, block_bytes: int, slots: int) -> None:
        self._store = store
        self._block_bytes = block_bytes
        self._free = [bytearray(block_bytes) for _ in range(slots)]
        self._resident: OrderedDict[bytes, bytearray] = OrderedDict()  # LRU of loaded blocks
        self._queue: list[tuple[int, int, bytes]] = []
        self._queued: set[bytes] = set()
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self.hits = 0
        self.misses = 0
        self._thread = threading.Thread(target=self._run, name="gsa-prefetch", daemon=True)
        self._thread.start()

    def prefetch(self, block_ids: Sequence[bytes], priority: int = 0) -> None:
        """Queue loads; lower ``priority`` runs first, ties in submission order."""
        with self._cv:
            for block_id in block_ids:
                if block_id not in self._resident and block_id not in self._queued:
                    heapq.heappush(self._queue, (priority, next(self._seq), block_id))
                    self._queued.add(block_id)
            self._cv.notify()

    def get(self, block_ids: Sequence[bytes]) -> list[memoryview | None]:
        """Each block's bytes (None if the store lacks it); waits for queued loads of these blocks.

        A view stays valid until its slot is reused by a later load: consume it before then."""
        out: list[memoryview | None] = []
        for block_id in block_ids:
            with self._cv:
                self._cv.wait_for(lambda b=block_id: b not in self._queued or self._closed)
                buf = self._resident.get(block_id)
                if buf is not None:
                    self._resident.move_to_end(block_id)
                    self.hits += 1
                    out.append(memoryview(buf))
                    continue
                self.misses += 1
            out.append(self._load(block_id))
        return out

    def _load(self, block_id: bytes) -> memoryview | None:
        with self._cv:
            buf = self._slot()
        ok = self._store.wait(self._store.load([block_id], [buf]))[0]
        with self._cv:
            if not ok:
                self._free.append(buf)
                return None
            self._resident[block_id] = buf
            return memoryview(buf)

    def _slot(self) -> bytearray:
        if self._free:
            return self._free.pop()
        _, buf = self._resident.popitem(last=False)  # evict the least recently used block
        return buf

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                _, _, block_id = heapq.heappop(self._queue)
            self._load(block_id)
            with self._cv:
                self._queued.discard(block_id)
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
