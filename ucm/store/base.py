"""The store protocol every backend implements.

A store maps block ids (bytes) to opaque payloads of fixed size. All operations are batched.
``dump`` and ``load`` return a :class:`Task` right away; the I/O runs in the background and the
task reports success per block. A failed block is never an exception on the serving path: the
caller sees ``False`` for it and recomputes.

Backends implement the underscored hooks (``_lookup``, ``_dump``, ``_load``); the public methods
here validate arguments and record metrics once for all of them.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ucm import metrics
from ucm.store.workers import IOThreads

logger = logging.getLogger(__name__)

# Anything exposing the buffer protocol: bytes, bytearray, memoryview, numpy arrays, ...
Buffer = Any
# A block's memory as backends see it: one flat byte view, or segments that hold the payload in
# order (e.g. one per layer, straight inside a paged KV cache, so nothing is staged or copied).
Blob = memoryview | list[memoryview]
# Called with a block's index in the batch and its bytes, once it has loaded (see Store.load);
# returns whether the block landed.
Landed = Callable[[int, memoryview], bool]


def blob_segments(blob: Blob) -> list[memoryview]:
    return blob if isinstance(blob, list) else [blob]


def blob_size(blob: Blob) -> int:
    return sum(s.nbytes for s in blob) if isinstance(blob, list) else blob.nbytes


def copy_to_blob(blob: Blob, data: memoryview) -> None:
    """Fill ``blob`` (its segments in order) from ``data`` of the same size."""
    at = 0
    for seg in blob_segments(blob):
        seg[:] = data[at : at + seg.nbytes]
        at += seg.nbytes


def copy_from_blob(dst: memoryview, blob: Blob) -> None:
    at = 0
    for seg in blob_segments(blob):
        dst[at : at + seg.nbytes] = seg
        at += seg.nbytes


class Task:
    """Completion handle for a batch of per-block operations.

    Parts of a batch may finish on different threads (or in different tiers); each reports its
    blocks with :meth:`_set`, and the task completes when every block has a result.
    """

    def __init__(self, num_blocks: int) -> None:
        self._ok = [False] * num_blocks
        self._remaining = num_blocks
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable[[Task], None]] = []
        if num_blocks == 0:
            self._done.set()

    @classmethod
    def completed(cls, ok: Sequence[bool]) -> Task:
        task = cls(len(ok))
        task._set(range(len(ok)), ok)
        return task

    def __len__(self) -> int:
        return len(self._ok)

    def _set(self, indices: Sequence[int], ok: Sequence[bool]) -> None:
        with self._lock:
            for i, good in zip(indices, ok, strict=True):
                self._ok[i] = bool(good)
            self._remaining -= len(indices)
            finished = self._remaining == 0
            callbacks = self._callbacks if finished else []
        if finished:
            self._done.set()
            for cb in callbacks:
                _run_callback(cb, self)

    def add_done_callback(self, fn: Callable[[Task], None]) -> None:
        """Call ``fn(task)`` once the task is complete (at once if it already is)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> list[bool]:
        """Per-block success, in the order the ids were given. Raises TimeoutError on timeout."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"store task of {len(self._ok)} blocks not done after {timeout} s")
        return list(self._ok)


def _run_callback(fn: Callable[[Task], None], task: Task) -> None:
    try:
        fn(task)
    except Exception:
        logger.exception("store task callback failed")


@dataclass(frozen=True)
class BlockInfo:
    """One stored block, as the admin tools see it."""

    block_id: bytes
    size: int
    mtime: float


class StoreError(RuntimeError):
    """A store cannot be created or cannot do what was asked (never raised for per-block I/O)."""


class Store(ABC):
    """Batch KV block store. Block ids are bytes; payloads are opaque, fixed-size per layout."""

    #: Registry name, also the ``backend`` label of this store's metrics.
    backend: str = "store"

    def lookup(self, ids: Sequence[bytes]) -> list[bool]:
        if not ids:
            return []
        start = time.perf_counter()
        found = self._lookup(ids)
        metrics.STORE_LOOKUP_BLOCKS.labels(self.backend).inc(len(ids))
        metrics.STORE_LOOKUP_HITS.labels(self.backend).inc(sum(found))
        metrics.STORE_OP_SECONDS.labels(self.backend, "lookup").observe(time.perf_counter() - start)
        return found

    def lookup_prefix(self, ids: Sequence[bytes]) -> int:
        """Number of leading ids that are all present."""
        for n, present in enumerate(self.lookup(ids)):
            if not present:
                return n
        return len(ids)

    def dump(self, ids: Sequence[bytes], payloads: Sequence[Buffer]) -> Task:
        """Store ``payloads`` (C-contiguous buffers, or lists of them holding one payload in order);
        they must stay unchanged until the task ends."""
        views = _byte_views("payloads", ids, payloads, writable=False)
        task = self._dump(ids, views)
        self._instrument(task, "dump", views)
        return task

    def load(self, ids: Sequence[bytes], buffers: Sequence[Buffer], landed: Landed | None = None) -> Task:
        """Fill the caller's writable ``buffers`` (each a buffer, or a list of segment buffers filled
        in order); a block is loaded only if its size matches.

        A block reported as failed may have left its buffer partly written.

        With ``landed`` (flat buffers only), each block that loaded is handed to ``landed(i, data)``
        before the task completes, on a store thread or the caller's; ``data`` holds its bytes
        during the call only. A store that has the bytes in memory of its own (one buffer per I/O
        thread, still in the CPU's cache when handed over; a DRAM tier's block) may leave
        ``buffers[i]`` unwritten. A block whose ``landed`` returns False or raises is reported as
        failed."""
        views = _byte_views("buffers", ids, buffers, writable=True)
        if landed is None:
            task = self._load(ids, views)
        elif any(isinstance(v, list) for v in views):
            raise ValueError("buffers: a load with `landed` takes flat buffers, not lists of segments")
        else:
            task = self._load_landed(ids, views, landed)
        self._instrument(task, "load", views)
        return task

    def wait(self, task: Task, timeout: float | None = None) -> list[bool]:
        return task.wait(timeout)

    def check(self, task: Task) -> bool:
        """True when ``task`` has finished (successfully or not, see :meth:`wait`)."""
        return task.done()

    def register_buffer(self, buffer: Buffer) -> None:  # noqa: B027 - optional hook, no-op by default
        """Hint that ``buffer`` will be used for many loads/dumps (lets RDMA-style stores pin it)."""

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release resources; pending tasks finish first."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Admin surface (the `ucm store` CLI). Backends that cannot list their blocks say so.
    def scan(self) -> Iterator[BlockInfo]:
        raise StoreError(f"{self.backend}: this store cannot list its blocks")

    def verify(self, repair: bool = False) -> list[bytes]:
        """Check every block; return ids of corrupt ones (deleted when ``repair``)."""
        raise StoreError(f"{self.backend}: this store cannot verify its blocks")

    def remove(self, ids: Sequence[bytes]) -> list[bool]:
        """Delete blocks; True where a block was there and is now gone."""
        raise StoreError(f"{self.backend}: this store cannot remove blocks")

    def gc(self, target_bytes: int) -> tuple[int, int]:
        """Evict least-recently-used blocks until at most ``target_bytes`` remain.

        Returns (blocks evicted, bytes evicted)."""
        raise StoreError(f"{self.backend}: this store does not support garbage collection")

    @abstractmethod
    def _lookup(self, ids: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def _dump(self, ids: Sequence[bytes], payloads: Sequence[Blob]) -> Task: ...

    @abstractmethod
    def _load(self, ids: Sequence[bytes], buffers: Sequence[Blob]) -> Task: ...

    def _load_landed(self, ids: Sequence[bytes], buffers: Sequence[memoryview], landed: Landed) -> Task:
        """Load into ``buffers``, then land every block that loaded, once all have."""
        task = Task(len(ids))

        def land(inner: Task) -> None:
            ok = inner.wait(0)
            task._set(range(len(ids)), [good and try_land(landed, i, buffers[i]) for i, good in enumerate(ok)])

        self._load(ids, buffers).add_done_callback(land)
        return task

    def _instrument(self, task: Task, op: str, views: Sequence[Blob]) -> None:
        start = time.perf_counter()
        sizes = [blob_size(v) for v in views]
        backend = self.backend

        def record(t: Task) -> None:
            ok = t.wait(0)
            n_ok = sum(ok)
            metrics.STORE_OP_SECONDS.labels(backend, op).observe(time.perf_counter() - start)
            metrics.STORE_BLOCKS.labels(backend, op, "ok").inc(n_ok)
            metrics.STORE_BLOCKS.labels(backend, op, "failed").inc(len(ok) - n_ok)
            metrics.STORE_BYTES.labels(backend, op).inc(sum(s for s, good in zip(sizes, ok, strict=True) if good))

        task.add_done_callback(record)


def _byte_views(name: str, ids: Sequence[bytes], buffers: Sequence[Buffer], writable: bool) -> list[Blob]:
    """Flat unsigned-byte views of the caller's buffers (no copies), checked once at the API edge."""
    if len(ids) != len(buffers):
        raise ValueError(f"{name}: got {len(buffers)} for {len(ids)} block ids; they must pair up")
    for block_id in ids:
        if not isinstance(block_id, bytes) or not block_id:
            raise TypeError(f"ids: block ids must be non-empty bytes, got {type(block_id).__name__}")
    blobs: list[Blob] = []
    for i, buf in enumerate(buffers):
        if isinstance(buf, (list, tuple)):
            if not buf:
                raise ValueError(f"{name}[{i}]: an empty list of segments")
            blobs.append([_flat(f"{name}[{i}][{j}]", seg, writable) for j, seg in enumerate(buf)])
        else:
            blobs.append(_flat(f"{name}[{i}]", buf, writable))
    return blobs


def _flat(name: str, buf: Buffer, writable: bool) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError(f"{name}: buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError(f"{name}: load buffers must be writable")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def try_land(landed: Landed, index: int, data: memoryview) -> bool:
    """``landed(index, data)``, False (logged) if it raised: the block then counts as not loaded."""
    try:
        return bool(landed(index, data))
    except Exception:
        logger.exception("landing block %d of a load failed; the block counts as not loaded", index)
        return False


def lookup_behind(found: list[bool], ids: Sequence[bytes], behind: Store) -> list[bool]:
    """A tier's lookup: what ``found`` (the tier's own answer) misses, asked of the store behind it."""
    missing = [k for k, hit in enumerate(found) if not hit]
    if missing:
        for k, hit in zip(missing, behind.lookup([ids[k] for k in missing]), strict=True):
            found[k] = hit
    return found


class PerBlockStore(Store):
    """A store whose I/O is one blocking call per block, run on a thread pool.

    A batch is cut into one contiguous chunk per thread (not one future per block), which keeps
    Python's per-task overhead off small blocks.
    """

    def __init__(self, io_threads: int) -> None:
        self._pool = IOThreads(io_threads, f"ucm-{self.backend}")
        self._io_threads = io_threads
        self._landing_buffers = threading.local()  # per I/O thread: landed loads read here

    @abstractmethod
    def _dump_block(self, block_id: bytes, payload: Blob) -> bool: ...

    @abstractmethod
    def _load_block(self, block_id: bytes, buffer: Blob) -> bool: ...

    def _dump(self, ids: Sequence[bytes], payloads: Sequence[Blob]) -> Task:
        return self._run(self._dump_block, ids, payloads)

    def _load(self, ids: Sequence[bytes], buffers: Sequence[Blob]) -> Task:
        return self._run(self._load_block, ids, buffers)

    def _load_landed(self, ids: Sequence[bytes], buffers: Sequence[memoryview], landed: Landed) -> Task:
        # Each block is read into this thread's buffer and landed at once, while it is still in the
        # CPU's cache: no write to the caller's buffer and read back (with direct_io the read still
        # goes through its aligned bounce buffer first).
        def read_and_land(index: int) -> bool:
            data = self._thread_buffer(buffers[index].nbytes)
            return self._load_block(ids[index], data) and try_land(landed, index, data)

        return self._run(lambda _id, index: read_and_land(index), ids, range(len(ids)))

    def _thread_buffer(self, nbytes: int) -> memoryview:
        buf = getattr(self._landing_buffers, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._landing_buffers.buf = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def _run(self, fn: Callable[[bytes, Any], bool], ids: Sequence[bytes], bufs: Sequence[Any]) -> Task:
        task = Task(len(ids))
        n = len(ids)
        chunks = min(n, self._io_threads)
        for c in range(chunks):
            lo, hi = n * c // chunks, n * (c + 1) // chunks
            self._pool.submit(self._run_chunk, task, fn, range(lo, hi), ids, bufs)
        return task

    def _run_chunk(
        self,
        task: Task,
        fn: Callable[[bytes, Any], bool],
        indices: range,
        ids: Sequence[bytes],
        bufs: Sequence[Any],
    ) -> None:
        # Each block is reported as it finishes, so that a caller waiting for the first blocks (or
        # copying landed ones) is not held for its whole share of the batch.
        for i in indices:
            try:
                ok = fn(ids[i], bufs[i])
            except Exception:
                # A backend bug must not hang the caller or reach the serving path: fail the block.
                logger.exception("%s: unexpected error on block %s", self.backend, ids[i].hex())
                ok = False
            task._set([i], [ok])

    def close(self) -> None:
        self._pool.close()
