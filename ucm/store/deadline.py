"""Store calls with a deadline, for callers that must never wait on a stuck store (vLLM's scheduler
loop): an NFS hard mount during an outage, a stuck FUSE mount or a stalled RPC would block a
``stat()`` forever.

Calls run on one worker thread. A call that misses its deadline gives the caller the fallback
answer (a miss) and keeps running in the background; while it is still stuck, later calls get the
fallback at once instead of queueing behind it, and ``stuck`` says so. When it returns, calls go to
the store again. ``on_stuck`` hears when a stuck call started (wall time) and ``on_answer`` when it
returned: the engine's ``/health`` reports the store degraded while it stays stuck (``health.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from ucm.store.workers import IOThreads

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Deadlined:
    def __init__(
        self,
        timeout_s: float,
        name: str,
        on_stuck: Callable[[float], None] | None = None,
        on_answer: Callable[[], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.name = name
        self._on_stuck = on_stuck
        self._on_answer = on_answer
        self._pool = IOThreads(1, f"{name}-deadlined")
        self._stuck: Future[object] | None = None
        self._lock = threading.Lock()
        self.timeouts = 0  # calls answered with the fallback because the store was too slow

    @property
    def stuck(self) -> bool:
        with self._lock:
            return self._stuck is not None and not self._stuck.done()

    def call(self, fn: Callable[[], T], fallback: T, timeout_s: float | None = None) -> T:
        """``fn()``, or ``fallback`` if it takes longer than ``timeout_s`` (default: ``self.timeout_s``)."""
        if self.stuck:
            self.timeouts += 1
            return fallback
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        started = time.time()
        future = self._pool.submit(fn)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            with self._lock:
                self._stuck = future  # type: ignore[assignment]
            self.timeouts += 1
            logger.warning("%s: no answer from the store in %.2f s; treating it as a miss", self.name, timeout_s)
            if self._on_stuck is not None:
                self._on_stuck(started)
            future.add_done_callback(lambda _: self._answered())
            return fallback

    def _answered(self) -> None:
        logger.warning("%s: the store answers again", self.name)
        if self._on_answer is not None:
            self._on_answer()

    def close(self) -> None:
        self._pool.close(timeout_s=0)
