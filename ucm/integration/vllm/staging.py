"""Host memory for the connector's transfers, kept across steps.

Loads, saves and Blend's chunk reads all pass through host staging; taking it from one pool
instead of allocating each time matters because fresh memory page-faults on first touch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ucm.store import Task


class StagingPool:
    """Staging kept across steps. Fresh host memory page-faults on first touch (~1.7 GB/s on the first
    dev VM, ~1.1 GB/s on the AVX2 one: gathering a 2,800-token prompt's 123 MiB for a save took
    96-114 ms into fresh memory, 16 ms into reused), which made a staged load cost twice its read.
    Free buffers are kept up to ``keep_bytes`` in all, and the largest always (it serves any smaller
    transfer). Buffers come back from the store's threads (a save's once written), hence the lock.
    A buffer whose read was abandoned comes back once that read ends (``give_when_done``)."""

    def __init__(self, new: Callable[[int], torch.Tensor], keep_bytes: int, rows: int = 0) -> None:
        self._new = new
        self._keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []  # largest first
        self._lock = threading.Lock()
        if rows:  # allocated and touched now, so the first load pays no page faults
            self._free.append(new(rows).zero_())

    def take(self, n: int) -> torch.Tensor:
        """A buffer of at least ``n`` rows: the smallest free one that has them, or a new one."""
        with self._lock:
            fits = [i for i, buf in enumerate(self._free) if buf.shape[0] >= n]
            if fits:
                return self._free.pop(fits[-1])
        return self._new(max(n, 1))

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            free = sorted([*self._free, buf], key=lambda b: b.shape[0], reverse=True)
            kept, total = free[:1], free[0].nbytes
            for b in free[1:]:
                if total + b.nbytes <= self._keep_bytes:
                    kept.append(b)
                    total += b.nbytes
            self._free = kept

    def give_when_done(self, buf: torch.Tensor, tasks: list[Task]) -> None:
        """Give ``buf`` back once every one of ``tasks`` (reads into it or writes from it) is done."""
        left = [len(tasks)]
        lock = threading.Lock()

        def done(_: Task) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.give(buf)

        if not tasks:
            self.give(buf)
        for task in tasks:
            task.add_done_callback(done)
