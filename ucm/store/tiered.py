"""A faster store in front of a slower one: UCM's ``storage_policy: tiered`` (the first root a fast
tier) and a file store in front of another in a pipeline (``cache|posix|nfs``).

- Dumps are written through to both, and done when the slow store has the block: the slow store
  is the shared one, where another engine (a PD decode on another host) looks. A fast copy that
  fails costs a later slow load, never a lost block.
- Lookups ask the fast store, then the slow one for what it lacks.
- Loads read from the fast store; what it lacks is read from the slow one and *promoted*: copied
  into the fast store in the background (``ucm_store_promoted_blocks_total``), so a hot block is
  served from the fast path next time.
- The fast store keeps itself under its own capacity, least recently used first. A block dropped
  from it is *demoted*: it is still in the slow store, where it was written through.

UCM's tiered policy moves blocks between tiers (one copy each); writing through instead keeps every
block where other hosts find it and keeps a crash from losing a block that was only in the fast
tier, for the cost of a second write.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence

from ucm import metrics
from ucm.config import ConfigError
from ucm.store import workers
from ucm.store.base import Blob, BlockInfo, Store, Task, lookup_behind
from ucm.store.posix import PosixConfig, PosixStore

logger = logging.getLogger(__name__)

# Promotions hold private copies until the fast store has written them; past this many bytes in
# flight a hit in the slow store is served without promoting it (memory stays bounded).
PROMOTE_MAX_PENDING = 256 << 20
FAST_SHARE_OF_FILESYSTEM = 0.9


class TieredStore(Store):
    backend = "tiered"

    def __init__(self, fast: Store, slow: Store) -> None:
        self.fast, self.slow = fast, slow
        self._pending = 0
        self._lock = threading.Condition()

    def _lookup(self, ids: Sequence[bytes]) -> list[bool]:
        return lookup_behind(self.fast.lookup(ids), ids, self.slow)

    def _dump(self, ids: Sequence[bytes], payloads: Sequence[Blob]) -> Task:
        task = Task(len(ids))
        slow = self.slow.dump(ids, payloads)
        fast = self.fast.dump(ids, payloads)
        # Done once both have written: the caller may reuse its payloads after that.
        fast.add_done_callback(lambda _f: slow.add_done_callback(lambda s: task._set(range(len(ids)), s.wait(0))))
        return task

    def _load(self, ids: Sequence[bytes], buffers: Sequence[Blob]) -> Task:
        task = Task(len(ids))

        def from_fast(t: Task) -> None:
            ok = t.wait(0)
            hits = [k for k, good in enumerate(ok) if good]
            misses = [k for k, good in enumerate(ok) if not good]
            if misses:
                slow = self.slow.load([ids[k] for k in misses], [buffers[k] for k in misses])

                def from_slow(s: Task) -> None:
                    loaded = s.wait(0)
                    found = [k for k, good in zip(misses, loaded, strict=True) if good]
                    self._promote([ids[k] for k in found], [buffers[k] for k in found])
                    task._set(misses, loaded)

                slow.add_done_callback(from_slow)
            task._set(hits, [True] * len(hits))

        self.fast.load(ids, buffers).add_done_callback(from_fast)
        return task

    def _promote(self, ids: list[bytes], buffers: list[Blob]) -> None:
        if not ids:
            return
        # Private copies: the caller owns its buffers again as soon as the load is done.
        copies = [b"".join(b) if isinstance(b, list) else bytes(b) for b in buffers]
        size = sum(len(c) for c in copies)
        with self._lock:
            if self._pending and self._pending + size > PROMOTE_MAX_PENDING:
                return
            self._pending += size

        def settle(t: Task) -> None:
            metrics.STORE_PROMOTED_BLOCKS.labels(self.fast.backend).inc(sum(t.wait(0)))
            with self._lock:
                self._pending -= size
                self._lock.notify_all()

        self.fast.dump(ids, copies).add_done_callback(settle)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every promotion has reached the fast store (at most ``timeout_s``); True if so."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout_s)

    # The slow store holds every block; the fast one copies of some.
    def scan(self) -> Iterator[BlockInfo]:
        return self.slow.scan()

    def verify(self, repair: bool = False) -> list[bytes]:
        corrupt = self.fast.verify(repair)
        seen = set(corrupt)
        return corrupt + [b for b in self.slow.verify(repair) if b not in seen]

    def remove(self, ids: Sequence[bytes]) -> list[bool]:
        fast = self.fast.remove(ids)
        return [a or b for a, b in zip(fast, self.slow.remove(ids), strict=True)]

    def gc(self, target_bytes: int) -> tuple[int, int]:
        return self.slow.gc(target_bytes)

    def register_buffer(self, buffer: object) -> None:
        self.fast.register_buffer(buffer)
        self.slow.register_buffer(buffer)

    def close(self) -> None:
        if not self.flush(workers.CLOSE_WAIT_S):
            logger.warning("tiered: closing with promotions unfinished; %s misses those copies", self.fast.backend)
        try:
            self.fast.close()
        finally:
            self.slow.close()


def tiered_posix(config: PosixConfig, backend: str) -> TieredStore:
    """``placement: tiered``: the first root a fast tier (its own capacity) before the others."""
    fast_root, *slow_roots = config.roots
    capacity = config.fast_capacity
    if capacity is None:
        try:
            fs = os.statvfs(fast_root)
        except OSError as exc:
            raise ConfigError(f"store.{backend}.roots[0]: cannot read {fast_root!r} ({exc.strerror})") from None
        capacity = int(fs.f_blocks * fs.f_frsize * FAST_SHARE_OF_FILESYSTEM)
    fast = config.model_copy(
        update={"roots": [fast_root], "placement": "hash", "capacity": capacity, "fast_capacity": None}
    )
    slow = config.model_copy(update={"roots": slow_roots, "placement": "hash", "fast_capacity": None})
    fast_store = PosixStore(fast, f"{backend}_fast")
    try:
        return TieredStore(fast_store, PosixStore(slow, backend))
    except BaseException:
        fast_store.close()
        raise
