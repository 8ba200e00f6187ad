"""Store I/O threads whose shutdown is bounded.

A store's I/O can hang for good (an NFS hard mount during an outage, a stuck FUSE mount, an RPC
that never answers). ``concurrent.futures.ThreadPoolExecutor`` cannot live with that: its threads
are joined without a limit when the interpreter exits, even after ``shutdown(wait=False)``, so one
stuck ``read()`` keeps an engine from ever exiting. These threads are daemons: ``close`` waits for
them up to a deadline, says which are still stuck, and the process exits without them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)

# How long closing a store waits for I/O already started (and writes already queued) to finish.
CLOSE_WAIT_S = 5.0

_STOP = object()


class IOThreads:
    """A fixed set of daemon threads running submitted calls in order of submission."""

    def __init__(self, count: int, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

    def close(self, timeout_s: float | None = None) -> bool:
        """Let the calls already submitted run, for at most ``timeout_s`` (default ``CLOSE_WAIT_S``)
        in all; True if every thread finished. Threads still stuck are left behind (daemons: they
        do not hold the exit)."""
        timeout_s = CLOSE_WAIT_S if timeout_s is None else timeout_s
        for _ in self._threads:
            self._queue.put(_STOP)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.warning("%s: I/O still running after %.1f s, left behind at close: %s", self.name, timeout_s, stuck)
        return not stuck
