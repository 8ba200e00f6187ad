"""File-per-block store on a POSIX filesystem (local disk, NFS, a 3FS FUSE mount).

Layout: ``<root>/<first 2 hex digits of the id>/<id in hex>``. With several roots, ``placement``
picks a block's root: ``hash`` by the id's last bytes (one place to look); ``round_robin`` or
``random`` per write (spread even when ids are not, but a lookup may look in every root);
``tiered`` makes the first root a fast tier in front of the others (``ucm.store.tiered``).
256 shard directories spread concurrent creates (one directory's lock would serialize
them) without the thousands of near-empty directories a second level would make.

On-disk format of one block: ``payload || trailer``. Putting the 32-byte trailer *after* the
payload lets a buffered load be a single ``preadv`` straight into the caller's buffer (no copy),
and keeps the payload at offset 0, aligned for O_DIRECT. The trailer holds a magic, a format
version, the payload length, an xxh3-64 checksum of the payload and the first 8 bytes of the
block id, so a torn, truncated, corrupted or misplaced file is detected and treated as a miss.
With ``mac_key_file`` the checksum field holds a keyed BLAKE3-64 of the block id and payload
instead (flag bit 0): on a shared store, whoever can write files but lacks the key cannot plant a
block a reader accepts — the checksum alone detects corruption, not forgery.

Writers write to a unique temporary name and ``rename`` it into place: readers see a whole block
or none, whoever crashes (SIGKILL, ENOSPC) mid-write. Readers hold an open descriptor while they
read, so a block evicted by another process mid-read is still read whole (or, opened after the
unlink, is a clean miss).

Eviction is LRU by mtime: loads refresh a block's mtime at most every ``touch_interval_s``.
With a ``capacity``, a capacity check reads the used bytes from the writers' ledgers
(``ucm.store.usage``), not from a walk of every block; a walk runs for an eviction pass and at
least every ``usage_walk_interval_s`` to correct what the ledgers missed.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import mmap
import os
import random
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Literal, TypeVar

import blake3
import xxhash
from pydantic import ByteSize, Field, model_validator

from ucm import metrics
from ucm.config import ConfigError, StrictModel
from ucm.store import workers
from ucm.store.base import Blob, BlockInfo, PerBlockStore, blob_segments, blob_size, copy_from_blob, copy_to_blob
from ucm.store.usage import Oldest, Usage

logger = logging.getLogger(__name__)
# KV reveals the prompts it was computed from: owner and group only (pods of a deployment share
# a group through fsGroup), never the world.
FILE_MODE, DIR_MODE = 0o640, 0o750

MAGIC = b"UCMB"
FORMAT_VERSION = 1
# magic, format version, flags, payload length, xxh3-64 of payload (or its MAC), block id prefix
TRAILER = struct.Struct("<4sHHQQ8s")
FLAG_MAC = 1
TMP_SUFFIX = ".tmp"
# A temporary file this old was left by a writer that died; the GC pass removes it.
STALE_TMP_S = 3600.0
_ALIGN = 4096
_GC_LOCK = ".ucm-gc.lock"
_WRITERS = ".ucm-writers"  # a file per process that wrote lately: they share the write budget between checks
_MAC_CONTEXT = "UCM posix store 2026-11 block MAC"
T = TypeVar("T")


class PosixConfig(StrictModel):
    roots: list[str] = Field(min_length=1, description="Directories holding blocks (see placement)")
    placement: Literal["hash", "round_robin", "random", "tiered"] = Field(
        "hash",
        description="How blocks spread over the roots: hash (by block id; a lookup looks in one root), "
        "round_robin or random (per write; a lookup may look in every root), tiered (the first root is a fast "
        "tier: blocks are written through to the others, promoted to it on a hit, dropped from it least "
        "recently used first)",
    )
    fast_capacity: ByteSize | None = Field(
        None, gt=0, description="placement tiered: bytes the first root holds; default 90% of its filesystem"
    )
    io_threads: int = Field(8, ge=1, le=256, description="Parallel block reads/writes")
    direct_io: bool = Field(False, description="Bypass the page cache with O_DIRECT (aligned bounce buffers)")
    fsync: bool = Field(False, description="fsync each block and its directory: survives power loss")
    capacity: ByteSize | None = Field(None, gt=0, description="Evict least-recently-used blocks above this")
    evict_to: float = Field(0.9, gt=0, lt=1, description="Fraction of capacity left after an eviction pass")
    eviction_interval_s: float = Field(10.0, gt=0, description="Longest wait between capacity checks")
    touch_interval_s: float = Field(60.0, ge=0, description="Loads refresh a block's LRU time this often")
    usage_walk_interval_s: float = Field(
        3600.0,
        gt=0,
        description="With a capacity: the longest time between two full walks of the store that correct its "
        "used bytes, which capacity checks otherwise read from the writers' ledgers (a walk of a million blocks "
        "takes seconds on a local disk, much longer over NFS)",
    )
    stale_handle_retries: int = Field(0, ge=0, le=10, description="Retries on ESTALE (NFS)")
    verify_checksum: bool = Field(
        True,
        description="Hash every loaded payload (costs ~15% of a page-cache read); false trusts storage "
        "that checksums end to end. Length, magic and id are always checked.",
    )
    mac_key_file: Path | None = Field(
        None,
        description="A file holding a secret (>= 16 bytes) shared by every pod of the store: blocks carry "
        "a keyed MAC instead of a checksum, always verified; blocks without a valid one are misses",
    )

    def mac_key(self) -> bytes | None:
        if self.mac_key_file is None:
            return None
        try:
            key = self.mac_key_file.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"mac_key_file: cannot read {self.mac_key_file}: {exc.strerror}") from None
        if len(key) < 16:
            raise ConfigError(f"mac_key_file: {self.mac_key_file} holds {len(key)} bytes; at least 16 are needed")
        # BLAKE3 keys are 32 bytes: derive one from any length of secret, bound to this use.
        return blake3.blake3(key, derive_key_context=_MAC_CONTEXT).digest()

    @model_validator(mode="after")
    def _tiers(self) -> PosixConfig:
        if self.placement == "tiered" and len(self.roots) < 2:
            raise ValueError("placement tiered needs at least two roots: the fast tier first, then the others")
        if self.fast_capacity is not None and self.placement != "tiered":
            raise ValueError("fast_capacity is for placement tiered")
        return self


class NfsConfig(PosixConfig):
    """NFS: no shared page cache between clients, so fsync before rename makes a block visible to
    other hosts whole; renames and unlinks can leave other clients with stale handles (retried)."""

    fsync: bool = Field(
        True,
        description="fsync each block before its rename and its directory after: other hosts see the block "
        "whole, and it survives power loss",
    )
    stale_handle_retries: int = Field(
        3,
        ge=0,
        le=10,
        description="Retries of a block read or write, or an existence check, that fails with ESTALE (a handle "
        "another client's rename or unlink made stale), after 1 ms, 2 ms, 4 ms...",
    )


class Ds3fsConfig(PosixConfig):
    """3FS through its FUSE mount: POSIX semantics, with atomic rename on the 3FS metadata service."""


class PosixStore(PerBlockStore):
    backend = "posix"

    def __init__(self, config: PosixConfig, backend: str = "posix") -> None:
        self.backend = backend
        self.config = config
        if config.placement == "tiered":
            raise ConfigError(f"store.{backend}.placement: tiered is built by create_store (ucm.store.tiered)")
        self._roots = [_checked_root(backend, i, r, config.direct_io) for i, r in enumerate(config.roots)]
        self._next_root = itertools.count()
        self._key = config.mac_key()
        super().__init__(config.io_threads)
        self._tls = threading.local()
        self._closed = threading.Event()
        self._gc_wakeup = threading.Event()
        self._written_lock = threading.Lock()
        self._written_since_check = 0
        self._evictor: threading.Thread | None = None
        self._usage: Usage | None = None
        if config.capacity is not None:
            self._usage = Usage(self._roots[0], int(config.capacity), config.usage_walk_interval_s)
            # Between the high watermark and capacity lies half the eviction gap. The writers of the
            # store share an eighth of the gap: a writer wakes its evictor after its share and, if
            # no check has run by twice its share, runs one itself before writing on. Together they
            # write at most a quarter of the gap between two checks. Shares are recounted per check.
            self._write_budget = int(int(config.capacity) * (1 - config.evict_to) / 8)
            self._writer_mark = os.path.join(self._roots[0], _WRITERS, f"{socket.gethostname()}-{os.getpid()}")
            self._check_every_bytes = max(1, self._write_budget // self._active_writers())
            self._high_watermark = int(int(config.capacity) * (config.evict_to + (1 - config.evict_to) / 2))
            metrics.STORE_CAPACITY_BYTES.labels(backend).set(int(config.capacity))
            self._evictor = threading.Thread(target=self._evict_loop, name=f"ucm-{backend}-evict", daemon=True)
            self._evictor.start()

    # -- paths -------------------------------------------------------------------------------
    def _paths(self, block_id: bytes) -> list[str]:
        """Where the block may be: its one root by hash, or (placed per write) any root."""
        name = block_id.hex()
        if self.config.placement == "hash":
            roots = [self._roots[int.from_bytes(block_id[-4:], "little") % len(self._roots)]]
        else:
            roots = self._roots
        return [os.path.join(root, name[0:2], name) for root in roots]

    def _new_path(self, paths: list[str]) -> str:
        """Where a new block is written, of the places it may be (:meth:`_paths`)."""
        if self.config.placement == "round_robin":
            return paths[next(self._next_root) % len(paths)]
        return random.choice(paths) if self.config.placement == "random" else paths[0]

    # -- protocol ----------------------------------------------------------------------------
    def _lookup(self, ids: list[bytes]) -> list[bool]:
        return [any(self._exists(p) for p in self._paths(i)) for i in ids]

    def _load_block(self, block_id: bytes, buffer: Blob) -> bool:
        for path in self._paths(block_id):
            try:
                return self._retry_stale(self._read_block, path, block_id, buffer)
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("%s: load of %s failed: %s", self.backend, path, exc)
                return False
        return False

    def _dump_block(self, block_id: bytes, payload: Blob) -> bool:
        paths = self._paths(block_id)
        for path in paths:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("%s: stat of %s failed: %s", self.backend, path, exc)
                return False
            # content-addressed: an existing block already holds these bytes
            self._maybe_touch(path, st.st_mtime)
            return True
        path = self._new_path(paths)
        size = blob_size(payload)
        flags = FLAG_MAC if self._key else 0
        trailer = TRAILER.pack(
            MAGIC, FORMAT_VERSION, flags, size, _checksum(payload, block_id, self._key), block_id[:8]
        )
        try:
            self._retry_stale(self._write_block, path, payload, trailer)
        except OSError as exc:
            level = logging.WARNING if exc.errno in (errno.ENOSPC, errno.EDQUOT) else logging.ERROR
            logger.log(level, "%s: dump of %s failed: %s", self.backend, path, exc)
            return False
        self._account_written(size + TRAILER.size)
        return True

    # -- reading -----------------------------------------------------------------------------
    def _read_block(self, path: str, block_id: bytes, buffer: Blob) -> bool:
        size = blob_size(buffer)
        expected = size + TRAILER.size
        # Never follow a link out of the store, and never wait on something that is not a file (a
        # FIFO at a block's path would block the open, and the engine step with it).
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        flags |= os.O_DIRECT if self.config.direct_io else 0
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            self._quarantine(path, "a symbolic link")
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._quarantine(path, "not a regular file")
                return False
            if st.st_size != expected:
                return self._reject_size(fd, path, block_id, st.st_size, expected)
            if self.config.direct_io:
                bounce = self._bounce(_round_up(expected))
                n = os.preadv(fd, [bounce], 0)
                copy_to_blob(buffer, bounce[:size])
                trailer = bounce[size:expected]
            else:
                trailer = self._trailer_buffer()
                n = os.preadv(fd, [*blob_segments(buffer), trailer], 0)
        finally:
            os.close(fd)
        check = self.config.verify_checksum or self._key is not None  # a MAC is always checked
        if n < expected or not _trailer_matches(trailer, block_id, buffer, self._key, check):
            self._quarantine(path, "checksum or trailer mismatch")
            return False
        self._maybe_touch(path, st.st_mtime)
        return True

    def _reject_size(self, fd: int, path: str, block_id: bytes, size: int, expected: int) -> bool:
        """A size mismatch is either a corrupt file or a caller whose buffer has the wrong size. The
        trailer is read from the descriptor already open: opening the path again could find
        something else there (a FIFO would block the engine step)."""
        raw = self._tail(fd, size) if size >= TRAILER.size else b""
        if len(raw) == TRAILER.size:
            magic, version, _flags, length, _sum, tag = TRAILER.unpack(raw)
            if magic == MAGIC and version == FORMAT_VERSION and length == size - TRAILER.size and tag == block_id[:8]:
                logger.warning(
                    "%s: block %s holds %d bytes but the load buffer has %d; not loaded",
                    self.backend,
                    path,
                    length,
                    expected - TRAILER.size,
                )
                return False
        self._quarantine(path, f"size {size} does not match its trailer")
        return False

    def _tail(self, fd: int, size: int) -> bytes:
        """The last TRAILER.size bytes of a file of ``size`` bytes (aligned reads under O_DIRECT)."""
        if not self.config.direct_io:
            return os.pread(fd, TRAILER.size, size - TRAILER.size)
        start = (size - TRAILER.size) // _ALIGN * _ALIGN
        bounce = self._bounce(_round_up(size - start))
        n = os.preadv(fd, [bounce], start)
        return bytes(bounce[size - TRAILER.size - start : size - start]) if n >= size - start else b""

    def _quarantine(self, path: str, why: str) -> None:
        # Removing it lets the next dump of this block write a good copy (dumps skip existing ids).
        metrics.STORE_CORRUPT_BLOCKS.labels(self.backend).inc()
        logger.warning("%s: corrupt block %s (%s); treated as a miss and removed", self.backend, path, why)
        try:
            os.unlink(path)
        except OSError:
            pass

    # -- writing -----------------------------------------------------------------------------
    def _write_block(self, path: str, payload: Blob, trailer: bytes) -> None:
        tmp = f"{path}.{os.urandom(6).hex()}{TMP_SUFFIX}"
        payload_size = blob_size(payload)
        size = payload_size + TRAILER.size
        try:
            fd = self._create(tmp)
            try:
                if self.config.direct_io:
                    bounce = self._bounce(_round_up(size))
                    copy_from_blob(bounce, payload)
                    bounce[payload_size:size] = trailer
                    _write_all(fd, [bounce])
                    os.ftruncate(fd, size)
                else:
                    _write_all(fd, [*blob_segments(payload), memoryview(trailer)])
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        if self.config.fsync:
            _fsync_dir(os.path.dirname(path))

    def _create(self, tmp: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if self.config.direct_io else 0)
        try:
            return os.open(tmp, flags, FILE_MODE)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(tmp), DIR_MODE, exist_ok=True)
            return os.open(tmp, flags, FILE_MODE)

    # -- helpers -----------------------------------------------------------------------------
    def _retry_stale(self, fn: Callable[..., T], *args: object) -> T:
        """Call ``fn``; on NFS's ESTALE (a handle made stale by another client) try again."""
        for attempt in range(self.config.stale_handle_retries):
            try:
                return fn(*args)
            except OSError as exc:
                if exc.errno != errno.ESTALE:
                    raise
                time.sleep(0.001 * 2**attempt)
        return fn(*args)

    def _exists(self, path: str) -> bool:
        try:  # os.stat, not os.path.exists: that one reads ESTALE as "missing", never to be retried
            self._retry_stale(os.stat, path)
        except OSError:  # missing, or still stale after the retries
            return False
        return True

    def _maybe_touch(self, path: str, mtime: float) -> None:
        now = time.time()
        if now - mtime >= self.config.touch_interval_s:
            try:
                os.utime(path, (now, now))
            except OSError:
                pass  # evicted meanwhile: nothing to refresh

    def _trailer_buffer(self) -> bytearray:
        buf = getattr(self._tls, "trailer", None)
        if buf is None:
            buf = self._tls.trailer = bytearray(TRAILER.size)
        return buf

    def _bounce(self, size: int) -> memoryview:
        """A page-aligned per-thread buffer for O_DIRECT, grown on demand."""
        mm = getattr(self._tls, "bounce", None)
        if mm is None or len(mm) < size:
            mm = self._tls.bounce = mmap.mmap(-1, size)
        return memoryview(mm)[:size]

    # -- capacity and admin --------------------------------------------------------------------
    def _account_written(self, nbytes: int) -> None:
        if self._usage is None:
            return
        self._usage.add(nbytes)
        with self._written_lock:
            self._written_since_check += nbytes
            pending = self._written_since_check
            behind = pending >= 2 * self._check_every_bytes
            if behind:
                self._written_since_check = 0
        if behind:  # the evictor has not caught up with this writer: it waits for a check
            self.enforce_capacity()
        elif pending >= self._check_every_bytes:
            self._gc_wakeup.set()

    def _evict_loop(self) -> None:
        while not self._closed.is_set():
            self._gc_wakeup.wait(self.config.eviction_interval_s)
            self._gc_wakeup.clear()
            if self._closed.is_set():
                return
            assert self._usage is not None
            self._usage.flush()  # also when idle: a ledger left unwritten for long is taken for a stopped store's
            with self._written_lock:
                wrote, self._written_since_check = self._written_since_check, 0
            if wrote:  # a process that writes nothing leaves eviction to those that do
                try:
                    self._check_every_bytes = max(1, self._write_budget // self._active_writers())
                    if self._check(wait=False) is None:  # another's pass ran: these writes stay counted
                        with self._written_lock:
                            self._written_since_check += wrote
                except Exception:
                    logger.exception("%s: eviction pass failed", self.backend)
        _unlink_quietly(self._writer_mark)

    def _active_writers(self) -> int:
        """This process and the others that marked a write within the last few check intervals."""
        os.makedirs(os.path.dirname(self._writer_mark), exist_ok=True)
        with open(self._writer_mark, "a"):
            os.utime(self._writer_mark)
        recent = time.time() - 3 * self.config.eviction_interval_s
        with os.scandir(os.path.dirname(self._writer_mark)) as it:
            return max(1, sum(1 for e in it if _mtime(e) >= recent))

    def enforce_capacity(self) -> tuple[int, int]:
        """One capacity check: above the high watermark, evict down to ``evict_to`` x capacity.
        Returns the blocks and bytes evicted."""
        return self._check(wait=True) or (0, 0)

    def _check(self, wait: bool) -> tuple[int, int] | None:
        """One pass at a time runs over a store (an advisory lock on the first root). The background
        evictor does not wait for another process's pass (None: skipped); a writer it has not
        caught up with does."""
        assert self.config.capacity is not None
        lock_path = os.path.join(self._roots[0], _GC_LOCK)
        with open(lock_path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                return None
            assert self._usage is not None
            used = self._usage.used()
            if used is None:
                used = self._walk()
            n = freed = 0
            if used > self._high_watermark:
                target = int(int(self.config.capacity) * self.config.evict_to)
                n, freed = self._evict_oldest(used - target)
                if used - freed > target:  # the last walk's oldest blocks ran out: walk for the next
                    used = self._walk() + freed
                    more, more_freed = self._evict_oldest(used - freed - target)
                    n, freed = n + more, freed + more_freed
            metrics.STORE_USED_BYTES.labels(self.backend).set(used - freed)
            return n, freed

    def _walk(self) -> int:
        """Walk every block: record the used bytes and the oldest blocks (enough for about eight
        eviction passes, each from the high watermark down to ``evict_to``); returns the bytes."""
        assert self._usage is not None and self.config.capacity is not None
        at_walk = self._usage.before_walk()
        entries = sorted(self._scan_entries(), key=lambda e: e.mtime)
        used = sum(e.size for e in entries)
        keep, oldest = 4 * int(self.config.capacity) * (1 - self.config.evict_to), []
        for e in entries:
            if keep <= 0:
                break
            oldest.append((e.mtime, e.size, e.path))
            keep -= e.size
        self._usage.record_walk(used, at_walk, oldest)
        return used

    def _evict_oldest(self, need: int) -> tuple[int, int]:
        """Evict at least ``need`` bytes from the last walk's oldest blocks, each still as old as
        the walk saw it (a load since refreshed it: it stays); fewer when the list runs out."""
        assert self._usage is not None
        return self._unlink_oldest(self._usage.take_oldest(), need)

    def remove(self, ids: Sequence[bytes]) -> list[bool]:
        removed = []
        for block_id in ids:
            gone = False
            for path in self._paths(block_id):
                try:
                    size = os.lstat(path).st_size if self._usage is not None else 0
                    os.unlink(path)
                    gone = True
                except FileNotFoundError:
                    continue
                if self._usage is not None:
                    self._usage.add(-size)
            removed.append(gone)
        return removed

    def gc(self, target_bytes: int) -> tuple[int, int]:
        entries = sorted(self._scan_entries(), key=lambda e: e.mtime)
        need = sum(e.size for e in entries) - target_bytes
        return self._unlink_oldest(((e.mtime, e.size, e.path) for e in entries), need)

    def _unlink_oldest(self, oldest: Generator[Oldest, None, None], need: int) -> tuple[int, int]:
        """Unlink blocks from ``oldest`` until ``need`` bytes are freed, skipping those whose mtime
        moved since it was listed (refreshed by a load: no longer the oldest) or that are gone."""
        n = freed = 0
        try:
            for mtime, size, path in oldest if need > 0 else ():
                try:
                    if os.lstat(path).st_mtime != mtime:
                        continue
                    os.unlink(path)
                except FileNotFoundError:
                    continue  # removed since the walk (another process, a corrupt block)
                except OSError as exc:  # one entry that will not go (EBUSY, EACCES, ESTALE) stops nothing
                    logger.warning("%s: cannot evict %s: %s", self.backend, path, exc.strerror or exc)
                    continue
                freed += size
                n += 1
                if self._usage is not None:  # per block: a writer killed mid-pass loses at most a flush's worth
                    self._usage.add(-size)
                if freed >= need:
                    break
        finally:
            oldest.close()  # the walk's list: marks what was taken
        if n:
            metrics.STORE_EVICTED_BLOCKS.labels(self.backend).inc(n)
            metrics.STORE_EVICTED_BYTES.labels(self.backend).inc(freed)
            logger.info("%s: evicted %d blocks (%d bytes)", self.backend, n, freed)
        return n, freed

    def scan(self) -> Iterator[BlockInfo]:
        for e in self._scan_entries():
            yield BlockInfo(bytes.fromhex(e.name), e.size, e.mtime)

    def _scan_entries(self) -> Iterator[_Entry]:
        """Every block file (regular files named by a block id); stale temporary files met on the
        way are removed. Anything else — other names, directories, links, entries that cannot be
        read — is skipped, so one odd entry never stops eviction or the admin commands."""
        now = time.time()
        for root in self._roots:
            for shard in _subdirs(root):
                try:
                    it = os.scandir(shard)
                except OSError as exc:
                    if not isinstance(exc, FileNotFoundError):
                        logger.warning("%s: cannot list %s: %s", self.backend, shard, exc.strerror or exc)
                    continue
                with it:
                    for entry in it:
                        try:
                            if not entry.is_file(follow_symlinks=False):
                                continue
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if entry.name.endswith(TMP_SUFFIX):
                            if now - st.st_mtime > STALE_TMP_S:
                                _unlink_quietly(entry.path)
                            continue
                        if _is_block_name(entry.name):
                            yield _Entry(entry.path, entry.name, st.st_size, st.st_mtime)

    def verify(self, repair: bool = False) -> list[bytes]:
        corrupt = []
        for e in self._scan_entries():
            block_id = bytes.fromhex(e.name)
            try:
                with open(e.path, "rb") as f:
                    data = memoryview(f.read())
            except FileNotFoundError:
                continue
            payload, trailer = data[: -TRAILER.size], data[-TRAILER.size :]
            if len(data) < TRAILER.size or not _trailer_matches(trailer, block_id, payload, self._key):
                corrupt.append(block_id)
                metrics.STORE_CORRUPT_BLOCKS.labels(self.backend).inc()
                if repair:
                    _unlink_quietly(e.path)
        return corrupt

    def close(self) -> None:
        self._closed.set()
        self._gc_wakeup.set()
        if self._evictor is not None:
            self._evictor.join(workers.CLOSE_WAIT_S)  # a daemon: one stuck in a hung mount stays behind
        super().close()
        if self._usage is not None:
            self._usage.close()


class _Entry:
    __slots__ = ("mtime", "name", "path", "size")

    def __init__(self, path: str, name: str, size: int, mtime: float) -> None:
        self.path, self.name, self.size, self.mtime = path, name, size, mtime


def _trailer_matches(
    trailer: memoryview, block_id: bytes, payload: Blob, key: bytes | None, check_sum: bool = True
) -> bool:
    magic, version, flags, length, checksum, tag = TRAILER.unpack(trailer)
    return (
        magic == MAGIC
        and version == FORMAT_VERSION
        and bool(flags & FLAG_MAC) == (key is not None)  # an unkeyed block in a keyed store is untrusted
        and length == blob_size(payload)
        and tag == block_id[:8]
        and (not check_sum or checksum == _checksum(payload, block_id, key))
    )


def _checksum(payload: Blob, block_id: bytes, key: bytes | None) -> int:
    """xxh3-64 of the payload, or with a key a BLAKE3-64 MAC of the block id and payload;
    streaming over segments gives the same digest as one buffer."""
    h = xxhash.xxh3_64() if key is None else blake3.blake3(block_id, key=key)
    for seg in payload if isinstance(payload, list) else [payload]:
        h.update(seg)
    return int.from_bytes(h.digest(8), "little") if key is not None else h.intdigest()


def _write_all(fd: int, parts: list[memoryview]) -> None:
    offset = 0
    parts = [memoryview(p).cast("B") for p in parts]
    while parts:
        n = os.pwritev(fd, parts, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += n
        while parts and n >= parts[0].nbytes:
            n -= parts[0].nbytes
            parts.pop(0)
        if n:
            parts[0] = parts[0][n:]


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _mtime(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0  # gone meanwhile: that writer stopped


def _subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.path for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


_HEX = frozenset("0123456789abcdef")


def _is_block_name(name: str) -> bool:
    """A block id in hex (what ``_path`` names files)."""
    return len(name) >= 2 and len(name) % 2 == 0 and all(c in _HEX for c in name)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checked_root(backend: str, index: int, root: str, direct_io: bool) -> str:
    """Fail at startup, naming the field, when a root cannot hold blocks."""
    field = f"store.{backend}.roots[{index}]"
    path = Path(root)
    if not path.is_dir():
        raise ConfigError(f"{field}: {root!r} does not exist or is not a directory")
    probe = path / f".ucm-probe-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
    except OSError as exc:
        raise ConfigError(f"{field}: {root!r} is not writable ({exc.strerror})") from None
    try:
        if direct_io:
            try:
                os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
            except OSError as exc:
                raise ConfigError(
                    f"store.{backend}.direct_io: {root!r} does not support O_DIRECT ({exc.strerror}); "
                    "set direct_io: false"
                ) from None
    finally:
        _unlink_quietly(probe)
    return str(path.resolve())
