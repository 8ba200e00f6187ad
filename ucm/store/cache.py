"""A DRAM tier (LRU, byte capacity) in front of another store.

Loads are served from memory when they can and read through to the backend otherwise, filling the
tier. Dumps go to both: ``through`` completes when the backend has the block; ``back`` completes
once the block is in memory and writes to the backend in the background, with at most
``write_back_max_pending`` bytes in flight (dumps wait beyond that, so memory stays bounded).

A dump runs on the engine's step, so ``back`` never waits on the backend without a bound: a dump
that finds no room within ``write_back_timeout_s`` fails (the block is in neither tier), and while
the backend then finishes no write (a hung NFS or 3FS server), later dumps that find no room fail
at once instead of each waiting again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import ByteSize, Field

from ucm import metrics
from ucm.config import StrictModel
from ucm.store.base import Blob, Landed, Store, Task, blob_size, copy_from_blob, copy_to_blob, lookup_behind, try_land

logger = logging.getLogger(__name__)


class CacheConfig(StrictModel):
    capacity: ByteSize = Field(gt=0, description="Bytes of payload kept in memory")
    write_mode: Literal["through", "back"] = Field("through", description="When a dump counts as done")
    write_back_max_pending: ByteSize = Field(
        ByteSize(256 << 20), gt=0, description="write_mode=back: most bytes not yet in the backend"
    )
    write_back_timeout_s: float = Field(
        2.0,
        gt=0,
        description="write_mode=back: a dump waits at most this long for room among the pending bytes, then "
        "fails (the block is not saved); closing waits at most this long for the pending writes",
    )


class CacheStore(Store):
    backend = "cache"

    def __init__(self, config: CacheConfig, backend_store: Store) -> None:
        self.config = config
        self.next = backend_store
        self._capacity = int(config.capacity)
        self._blocks: OrderedDict[bytes, bytearray] = OrderedDict()
        # Buffers of removed blocks, by size, reused before allocating: fresh memory costs a page
        # fault per 4 KiB on first write, which would cap dumps well below memcpy speed.
        self._free: dict[int, list[bytearray]] = {}
        self._used = 0
        self._free_bytes = 0
        # Copies in and out happen under the lock, so a buffer is never recycled mid-read.
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._pending_tasks: set[Task] = set()
        self._pending_cv = threading.Condition()
        # A dump timed out waiting for room and no write-back has finished since: the backend is stuck.
        self._backend_stuck = False

    # -- memory tier ---------------------------------------------------------------------------
    def _copy_out(self, block_id: bytes, dst: Blob) -> bool:
        def copy(held: memoryview) -> bool:
            copy_to_blob(dst, held)
            return True

        return self._use(block_id, blob_size(dst), copy) is not None

    def _use(self, block_id: bytes, size: int, use: Callable[[memoryview], bool]) -> bool | None:
        """``use(its bytes)`` for a block the tier holds at this size (under the lock, so its buffer
        is not recycled meanwhile), or None when it does not."""
        with self._lock:
            buf = self._blocks.get(block_id)
            if buf is None or len(buf) != size:
                return None
            self._blocks.move_to_end(block_id)
            return use(memoryview(buf))

    def _put(self, block_id: bytes, payload: Blob) -> None:
        size = blob_size(payload)
        if size > self._capacity:
            return
        with self._lock:
            if block_id in self._blocks:  # content-addressed: it already holds these bytes
                self._blocks.move_to_end(block_id)
                return
            buf = self._take_buffer(size)
            if buf is None:
                return
            self._used += size  # counted from here on, so other fills leave this room alone
        # Copied outside the lock: fresh memory page-faults on its first write (~0.6 ms per MiB
        # here), and the store's I/O threads filling the tier side by side would otherwise take turns.
        copy_from_blob(memoryview(buf), payload)
        with self._lock:
            if block_id in self._blocks:  # another thread put it meanwhile
                self._release(buf)
            else:
                self._blocks[block_id] = buf

    def _take_buffer(self, size: int) -> bytearray | None:
        """A buffer of ``size`` bytes within capacity: recycled, taken from the LRU block, or new;
        None when buffers being filled hold the room."""
        free = self._free.get(size)
        if free:
            self._free_bytes -= size
            return free.pop()
        evicted = 0
        try:
            while self._used + self._free_bytes + size > self._capacity:
                if self._free_bytes:
                    other = next(k for k, v in self._free.items() if v)
                    self._free[other].pop()
                    self._free_bytes -= other
                    continue
                if not self._blocks:
                    return None
                _, victim = self._blocks.popitem(last=False)
                self._used -= len(victim)
                evicted += 1
                if len(victim) == size:
                    return victim
            return bytearray(size)
        finally:
            if evicted:
                metrics.STORE_EVICTED_BLOCKS.labels(self.backend).inc(evicted)

    def _release(self, buf: bytearray) -> None:
        """A buffer no block holds any more, kept for reuse (under the lock)."""
        self._used -= len(buf)
        self._free.setdefault(len(buf), []).append(buf)
        self._free_bytes += len(buf)

    @property
    def used_bytes(self) -> int:
        return self._used

    # -- protocol ----------------------------------------------------------------------------
    def _lookup(self, ids: Sequence[bytes]) -> list[bool]:
        with self._lock:
            found = [i in self._blocks for i in ids]
        return lookup_behind(found, ids, self.next)

    def _load(self, ids: Sequence[bytes], buffers: Sequence[Blob]) -> Task:
        task = Task(len(ids))
        hits, misses = [], []
        for k, (block_id, buf) in enumerate(zip(ids, buffers, strict=True)):
            (hits if self._copy_out(block_id, buf) else misses).append(k)
        if misses:
            inner = self.next.load([ids[k] for k in misses], [buffers[k] for k in misses])

            def fill(t: Task) -> None:
                ok = t.wait(0)
                for k, good in zip(misses, ok, strict=True):
                    if good:
                        self._put(ids[k], buffers[k])
                task._set(misses, ok)

            inner.add_done_callback(fill)
        task._set(hits, [True] * len(hits))
        return task

    def _load_landed(self, ids: Sequence[bytes], buffers: Sequence[memoryview], landed: Landed) -> Task:
        # Blocks in memory land straight from the tier's own buffers (no copy into ``buffers``
        # first); the others land from the store behind as they arrive, and fill the tier on the way.
        task = Task(len(ids))
        hits, landed_ok, misses = [], [], []
        for k, block_id in enumerate(ids):
            ok = self._use(block_id, buffers[k].nbytes, lambda held, k=k: try_land(landed, k, held))
            if ok is None:
                misses.append(k)
            else:
                hits.append(k)
                landed_ok.append(ok)
        if misses:

            def fill_and_land(j: int, data: memoryview) -> bool:
                self._put(ids[misses[j]], data)
                return landed(misses[j], data)

            inner = self.next.load([ids[k] for k in misses], [buffers[k] for k in misses], fill_and_land)
            inner.add_done_callback(lambda t: task._set(misses, t.wait(0)))
        task._set(hits, landed_ok)
        return task

    def _dump(self, ids: Sequence[bytes], payloads: Sequence[Blob]) -> Task:
        if self.config.write_mode == "back":
            return self._write_back(ids, payloads)
        for block_id, payload in zip(ids, payloads, strict=True):
            self._put(block_id, payload)
        return self.next.dump(ids, payloads)

    def _write_back(self, ids: Sequence[bytes], payloads: Sequence[Blob]) -> Task:
        nbytes = sum(blob_size(p) for p in payloads)
        if not self._reserve(nbytes):
            # Not saved: kept out of memory too, so the caller's "not saved" holds for every reader.
            return Task.completed([False] * len(ids))
        # The backend writes from private copies: the caller may reuse its buffers at once.
        copies = [b"".join(p) if isinstance(p, list) else bytes(p) for p in payloads]
        for block_id, copy in zip(ids, copies, strict=True):
            self._put(block_id, memoryview(copy))
        inner = self.next.dump(list(ids), copies)
        with self._pending_cv:
            self._pending_tasks.add(inner)

        def settle(t: Task) -> None:
            failed = len(t) - sum(t.wait(0))
            if failed:
                logger.warning("cache: write-back of %d of %d blocks to %s failed", failed, len(t), self.next.backend)
            with self._pending_cv:
                self._pending_bytes -= nbytes
                self._pending_tasks.discard(t)
                self._backend_stuck = False
                self._pending_cv.notify_all()

        inner.add_done_callback(settle)
        return Task.completed([True] * len(ids))

    def _reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` as pending once they fit, waiting at most ``write_back_timeout_s`` (not at
        all while the backend is stuck); False when they do not fit in time."""
        limit = int(self.config.write_back_max_pending)
        with self._pending_cv:
            timeout = 0.0 if self._backend_stuck else self.config.write_back_timeout_s
            if not self._pending_cv.wait_for(
                lambda: self._pending_bytes == 0 or self._pending_bytes + nbytes <= limit, timeout
            ):
                if not self._backend_stuck:
                    logger.warning(
                        "cache: %s finished no pending write in %.1f s; dumps finding no room fail until it does",
                        self.next.backend,
                        timeout,
                    )
                self._backend_stuck = True
                return False
            self._pending_bytes += nbytes
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write-back has reached the backend, at most ``timeout`` seconds; True if so."""
        with self._pending_cv:
            return self._pending_cv.wait_for(lambda: not self._pending_tasks, timeout)

    def scan(self):  # type: ignore[no-untyped-def]
        return self.next.scan()

    def verify(self, repair: bool = False) -> list[bytes]:
        return self.next.verify(repair)

    def remove(self, ids: Sequence[bytes]) -> list[bool]:
        with self._lock:
            for block_id in ids:
                buf = self._blocks.pop(block_id, None)
                if buf is not None:
                    self._release(buf)
        return self.next.remove(ids)

    def gc(self, target_bytes: int) -> tuple[int, int]:
        return self.next.gc(target_bytes)

    def register_buffer(self, buffer: object) -> None:
        self.next.register_buffer(buffer)

    def close(self) -> None:
        if not self.flush(self.config.write_back_timeout_s):
            logger.warning(
                "cache: closing with %d write-backs to %s not done after %.1f s; those blocks are not saved there",
                len(self._pending_tasks),
                self.next.backend,
                self.config.write_back_timeout_s,
            )
        self.next.close()
