"""The used bytes of a shared file store, kept as it changes instead of walked for each check.

Each store instance that enforces a capacity (one per engine process, one per admin command) owns
a ledger file under ``<first root>/.ucm-usage/``: the net bytes it has written and evicted since it
started, rewritten whole (temporary file and rename) once a second while it writes, after each
thousandth of the capacity it writes, and at every capacity check. A full walk of the blocks
records what it found beside the ledgers as they stood when it began, and a capacity check reads
only the ledgers:

    used = walked bytes + sum over ledgers of (ledger now - ledger at the walk)

so its cost grows with the processes writing to the store, not with the blocks it holds. Each
process writes only its own file: no lock, no read-modify-write over NFS, no double counting of
one writer's blocks by another.

What the ledgers cannot see drifts until the next walk corrects it: what a writer wrote since its
last flush when it was killed (at most a thousandth of the capacity), a block two writers renamed
into place at the same moment, a corrupt block removed on load, files removed by hand or by a
store instance without a capacity. The walk runs when no record is younger than
``walk_interval_s`` (the store's ``usage_walk_interval_s``).

The walk also keeps the oldest blocks it saw, oldest first, in a file beside its record (enough
for several eviction passes): a pass takes the next ones from there, checking each is still as old
(a load that refreshed it, or a rewrite, moved its mtime: it stays), instead of walking the store
for the blocks' ages. Blocks written since the walk are younger than every one listed. When the
list runs out, the pass walks again.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Generator
from typing import Any

logger = logging.getLogger(__name__)

DIRECTORY = ".ucm-usage"
_RECORD = "walk.json"  # the last full walk: {"at": unix time, "bytes": walked, "ledgers": {name: bytes}, "taken": n}
_OLDEST = "oldest"  # the walk's oldest blocks, a line each, "mtime size path", oldest first; "taken" bytes used
_NOT_LEDGERS = (_RECORD, _OLDEST)
_TMP = ".tmp"
FLUSH_S = 1.0  # others read a writer's ledger at most this late
FLUSH_SHARE = 1000  # a writer killed loses at most capacity / FLUSH_SHARE of the count
# A ledger this old belongs to a store instance that stopped: a walk folds it into its record (its
# bytes are in the walk). A live instance rewrites its own at every evictor wake-up.
STOPPED_AFTER_S = 3600.0

Ledgers = dict[str, int]
Oldest = tuple[float, int, str]  # mtime, size, path (as the store names it)


class Usage:
    """One store instance's ledger, and the reading of all of them (see the module's docstring)."""

    def __init__(self, root: str, capacity: int, walk_interval_s: float) -> None:
        self._dir = os.path.join(root, DIRECTORY)
        self._walk_interval_s = walk_interval_s
        self._flush_bytes = max(1, capacity // FLUSH_SHARE)
        # Random bits: two store instances of one process (tests, a tiered store) keep apart.
        self.name = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        self._path = os.path.join(self._dir, self.name)
        self._lock = threading.Lock()
        self._net = self._flushed_net = 0
        self._flushed_at = float("-inf")

    def add(self, nbytes: int) -> None:
        """Count bytes this instance wrote (positive) or removed (negative)."""
        with self._lock:
            self._net += nbytes
            if (
                abs(self._net - self._flushed_net) >= self._flush_bytes
                or time.monotonic() - self._flushed_at >= FLUSH_S
            ):
                self._flush_locked()

    def flush(self) -> None:
        """Write the ledger now (a capacity check; an evictor's wake-up: this instance is alive)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        try:
            _write_atomically(self._path, str(self._net))
        except OSError as exc:  # the next flush tries again; a walk corrects what stays unwritten
            logger.warning("store usage: cannot write %s: %s", self._path, exc.strerror or exc)
            return
        self._flushed_at, self._flushed_net = time.monotonic(), self._net

    def used(self) -> int | None:
        """The store's used bytes from the last walk and the ledgers; None when a walk is due (none
        recorded, or the last one older than the walk interval)."""
        record = self._record()
        if record is None or time.time() - record["at"] > self._walk_interval_s:
            return None
        at_walk: Ledgers = record["ledgers"]
        ledgers = self._read_ledgers()
        with self._lock:
            ledgers[self.name] = self._net  # this instance's own, up to its last write
        return int(record["bytes"]) + sum(n - at_walk.get(name, 0) for name, n in ledgers.items())

    def before_walk(self) -> Ledgers:
        """The ledgers as a walk starts (this instance's flushed first). Writes made during the
        walk may be counted twice until the next one: the count errs towards evicting early."""
        self.flush()
        return self._read_ledgers()

    def record_walk(self, walked: int, at_walk: Ledgers, oldest: list[Oldest]) -> None:
        """Record a walk and its oldest blocks (under the store's eviction lock, which keeps walks
        and passes one at a time). The ledgers of stopped instances are folded in: file and entry
        go together, the sum unchanged."""
        stopped_before = time.time() - STOPPED_AFTER_S
        try:
            with os.scandir(self._dir) as it:
                old = [e for e in it if e.name not in (self.name, *_NOT_LEDGERS) and _mtime(e) < stopped_before]
        except FileNotFoundError:  # no ledger written yet (the directory could not be made): nothing to fold
            old = []
        for entry in old:  # a stopped instance's ledger, or a temporary file a killed one left
            try:
                os.unlink(entry.path)
            except OSError:
                continue
            at_walk.pop(entry.name, None)
        try:
            # The list first: a record never points into another walk's list (a crash between the
            # two leaves an old record, and each listed block is checked before it goes anyway).
            _write_atomically(os.path.join(self._dir, _OLDEST), "".join(f"{m!r} {n} {p}\n" for m, n, p in oldest))
        except OSError as exc:  # the next check walks again
            logger.warning("store usage: cannot list the oldest blocks in %s: %s", self._dir, exc.strerror or exc)
            return
        self._rewrite({"at": time.time(), "bytes": walked, "ledgers": at_walk, "taken": 0})

    def take_oldest(self) -> Generator[Oldest, None, None]:
        """The walk's oldest blocks not taken yet, oldest first (under the eviction lock); what
        the caller consumed is marked taken when the iterator is closed."""
        record = self._record()
        if record is None:
            return
        taken = int(record.get("taken", 0))
        try:
            with open(os.path.join(self._dir, _OLDEST), "rb") as f:
                f.seek(taken)
                try:
                    for line in f:
                        taken += len(line)
                        try:
                            mtime, size, path = line.decode().rstrip("\n").split(" ", 2)
                            listed = float(mtime), int(size), path
                        except ValueError:  # a damaged line: that block waits for the next walk
                            continue
                        yield listed
                finally:
                    record["taken"] = taken
                    self._rewrite(record)
        except FileNotFoundError:
            return

    def _rewrite(self, record: dict[str, Any]) -> None:
        """A walk's record, or what a pass took from its list. When it cannot be written, the next
        check walks again (a new walk) or checks the same blocks again (gone: a stat each)."""
        try:
            _write_atomically(os.path.join(self._dir, _RECORD), json.dumps(record))
        except OSError as exc:
            logger.warning("store usage: cannot write the walk's record in %s: %s", self._dir, exc.strerror or exc)

    def close(self) -> None:
        self.flush()

    def _record(self) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self._dir, _RECORD)) as f:
                record = json.load(f)
            if isinstance(record.get("bytes"), int) and isinstance(record.get("ledgers"), dict):
                record["at"] = float(record["at"])
                return record
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            logger.warning("store usage: unreadable walk record in %s (%s); walking again", self._dir, exc)
            return None
        logger.warning("store usage: malformed walk record in %s; walking again", self._dir)
        return None

    def _read_ledgers(self) -> Ledgers:
        ledgers: Ledgers = {}
        try:
            it = os.scandir(self._dir)
        except FileNotFoundError:
            return ledgers
        with it:
            for entry in it:
                if entry.name in _NOT_LEDGERS or entry.name.endswith(_TMP):
                    continue
                try:
                    with open(entry.path) as f:
                        ledgers[entry.name] = int(f.read())
                except (OSError, ValueError):
                    continue  # removed meanwhile, or not a ledger: the walk counts what it misses
        return ledgers


def _mtime(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat().st_mtime
    except OSError:
        return float("inf")  # gone meanwhile: nothing to fold


def _write_atomically(path: str, text: str) -> None:
    """A reader sees the old content or the new, never a torn one (rename over NFS is atomic)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)  # also after the store's root was emptied by hand
    tmp = f"{path}.{os.urandom(4).hex()}{_TMP}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
