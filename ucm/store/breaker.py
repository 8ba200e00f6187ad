"""A circuit breaker in front of a store: a store that stops answering (a hung NFS or 3FS server) is
skipped instead of being waited on by every engine step.

Every load and dump that goes to the store is watched. One not done within ``timeout_s`` counts as
a timeout; one done in time ends the count. After ``timeouts`` in a row the store is *degraded*:
loads and dumps fail at once without reaching it (vLLM recomputes; a PD prefill promises its
decode nothing, so neither waits on the store), ``ucm_store_degraded`` is 1 and ``on_degraded``
hears since when (the engine's ``/health`` says so after ``store_unhealthy_after_s``). Every
``probe_interval_s`` a small write and read back is tried; the first that is done within
``timeout_s`` ends it. The probe runs on the breaker's own thread, so an idle engine (a prefill
the proxy skips while its store is degraded) recovers too.

A watched operation that was counted as a timeout and finishes later proves nothing: a store that
answers every call late stays degraded until a probe is done in time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from pydantic import Field

from ucm import metrics
from ucm.config import StrictModel
from ucm.store.base import Blob, Landed, Store, Task

logger = logging.getLogger(__name__)

# Not a block id of any request (those are 32-byte hashes): written and read back by probes.
PROBE_ID = b"ucm-store-probe"
PROBE_PAYLOAD = bytes(range(256))


class BreakerConfig(StrictModel):
    # One: every timeout is an engine step held for timeout_s (a load, or a PD save wait), and the
    # requests queued behind it wait as long; with 3, fault_serving's store hangs held requests for
    # 2-3x the deadline. A slow store that trips it costs a probe interval of recompute.
    timeouts: int = Field(
        1,
        ge=1,
        description="Store operations in a row not done within timeout_s that make the store degraded: skipped "
        "until a probe is answered within timeout_s",
    )
    timeout_s: float = Field(10.0, gt=0, description="A load or save not done by then counts as a timeout")
    probe_interval_s: float = Field(5.0, gt=0, description="How often a degraded store is probed")


class BreakerStore(Store):
    backend = "breaker"

    def __init__(
        self,
        store: Store,
        config: BreakerConfig,
        on_degraded: Callable[[float], None] | None = None,
        on_recovered: Callable[[], None] | None = None,
    ) -> None:
        self.inner = store
        self.guarded = store.backend  # the label of the degraded-state metrics
        self.config = config
        self._on_degraded = on_degraded
        self._on_recovered = on_recovered
        self._lock = threading.Lock()
        # Watched operations not finished yet: start (monotonic, wall), and whether counted as a timeout.
        self._pending: dict[Task, tuple[float, float, bool]] = {}
        self._in_a_row = 0
        self._streak_since = 0.0  # wall time the first timeout in a row started
        self._degraded = False
        self._probe: Task | None = None
        self._closed = threading.Event()
        metrics.STORE_DEGRADED.labels(self.guarded).set(0)
        self._watcher = threading.Thread(target=self._watch, name=f"ucm-{self.guarded}-breaker", daemon=True)
        self._watcher.start()

    @property
    def degraded(self) -> bool:
        return self._degraded

    # -- protocol: the store's own, or an immediate failure while it is degraded ----------------
    def _lookup(self, ids: Sequence[bytes]) -> list[bool]:
        return self.inner.lookup(ids)

    def _dump(self, ids: Sequence[bytes], payloads: Sequence[Blob]) -> Task:
        return self._guarded("dump", len(ids), lambda: self.inner.dump(ids, payloads))

    def _load(self, ids: Sequence[bytes], buffers: Sequence[Blob]) -> Task:
        return self._guarded("load", len(ids), lambda: self.inner.load(ids, buffers))

    def _load_landed(self, ids: Sequence[bytes], buffers: Sequence[memoryview], landed: Landed) -> Task:
        return self._guarded("load", len(ids), lambda: self.inner.load(ids, buffers, landed))

    def _guarded(self, op: str, n: int, call: Callable[[], Task]) -> Task:
        if self._degraded:
            metrics.STORE_SKIPPED_BLOCKS.labels(self.guarded, op).inc(n)
            return Task.completed([False] * n)
        task = call()
        with self._lock:
            self._pending[task] = (time.monotonic(), time.time(), False)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: Task) -> None:
        with self._lock:
            started, _, counted = self._pending.pop(task)
            if not counted and time.monotonic() - started <= self.config.timeout_s:
                self._in_a_row = 0

    # -- the watcher thread ----------------------------------------------------------------------
    def _watch(self) -> None:
        tick = min(self.config.timeout_s, self.config.probe_interval_s) / 4
        last_probe = time.monotonic()
        while not self._closed.wait(tick):
            self._count_timeouts()
            if self._degraded and time.monotonic() - last_probe >= self.config.probe_interval_s:
                last_probe = time.monotonic()
                if self._probe_done_in_time():
                    self._recover()

    def _count_timeouts(self) -> None:
        now = time.monotonic()
        with self._lock:
            for task, (started, wall, counted) in list(self._pending.items()):
                if counted or now - started <= self.config.timeout_s:
                    continue
                self._pending[task] = (started, wall, True)
                if self._in_a_row == 0:
                    self._streak_since = wall
                self._in_a_row += 1
            trip = not self._degraded and self._in_a_row >= self.config.timeouts
            if trip:
                self._degraded = True
            since = self._streak_since
        if trip:
            logger.warning(
                "%s: %d operations in a row not done within %.1f s; skipping the store until a probe is answered",
                self.guarded,
                self.config.timeouts,
                self.config.timeout_s,
            )
            metrics.STORE_DEGRADED.labels(self.guarded).set(1)
            if self._on_degraded is not None:
                self._on_degraded(since)

    def _probe_done_in_time(self) -> bool:
        """A small write and its read back, both done within ``timeout_s``. A probe still stuck from
        an earlier try is not joined by another (they would pile up in a hung store)."""
        if self._probe is not None and not self._probe.done():
            return False
        deadline = time.monotonic() + self.config.timeout_s
        try:
            self._probe = self.inner.dump([PROBE_ID], [PROBE_PAYLOAD])
            self._probe.wait(self.config.timeout_s)
            self._probe = self.inner.load([PROBE_ID], [bytearray(len(PROBE_PAYLOAD))])
            self._probe.wait(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        return True

    def _recover(self) -> None:
        with self._lock:
            self._degraded = False
            self._in_a_row = 0
        logger.warning("%s: a probe was answered in time; using the store again", self.guarded)
        metrics.STORE_DEGRADED.labels(self.guarded).set(0)
        if self._on_recovered is not None:
            self._on_recovered()

    def register_buffer(self, buffer: object) -> None:
        self.inner.register_buffer(buffer)

    def close(self) -> None:
        self._closed.set()
        self._watcher.join()
        self.inner.close()
