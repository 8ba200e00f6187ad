"""The circuit breaker: a store whose operations time out in a row is skipped until a probe is
answered in time.

``Recording`` with a closed gate is the blocking test double of the cache tier's tests: its writes
wait on an Event, standing in for a hung NFS or 3FS server (none can be hung here on demand)."""

import threading
import time

import pytest

from ucm.store import create_store
from ucm.store.breaker import PROBE_ID, BreakerConfig, BreakerStore

from .helpers import blocks, metric
from .test_cache import Recording

pytestmark = pytest.mark.engines  # times things tightly: make test runs it alone (ucm_testing.lanes)
FAST = BreakerConfig(timeouts=2, timeout_s=0.2, probe_interval_s=0.2)


def wait_until(condition, seconds: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_writes_that_hang_make_the_store_degraded_until_a_probe_is_answered():
    gate = threading.Event()
    back = Recording(gate)
    heard: list[object] = []
    breaker = BreakerStore(back, FAST, on_degraded=heard.append, on_recovered=lambda: heard.append("recovered"))
    ids, data = blocks(4, 100)
    try:
        started = time.time()
        hung = [breaker.dump(ids[i : i + 1], data[i : i + 1]) for i in range(2)]
        assert not breaker.degraded  # not yet past timeout_s
        wait_until(lambda: breaker.degraded)
        wait_until(lambda: bool(heard))  # the watcher sets the flag first, then tells
        assert started - 0.05 <= heard[0] <= started + 0.05  # since the first hung write began
        assert metric("ucm_store_degraded", backend="recording") == 1

        skipped = metric("ucm_store_skipped_blocks_total", backend="recording", op="dump")
        started = time.monotonic()
        assert breaker.wait(breaker.dump(ids[2:], data[2:]), 0) == [False, False]  # at once, not stored
        assert breaker.wait(breaker.load(ids[:1], [bytearray(100)]), 0) == [False]
        assert time.monotonic() - started < 0.05
        assert metric("ucm_store_skipped_blocks_total", backend="recording", op="dump") == skipped + 2

        time.sleep(3 * FAST.probe_interval_s)
        assert breaker.degraded  # probes of a store still hung are not answered
        gate.set()  # the server answers again
        wait_until(lambda: not breaker.degraded)
        wait_until(lambda: heard[-1] == "recovered")  # told after the flag is cleared
        assert metric("ucm_store_degraded", backend="recording") == 0
        assert all(t.done() for t in hung)
        assert breaker.wait(breaker.dump(ids[2:], data[2:]), 2) == [True, True]
        assert set(back.data) == {*ids, PROBE_ID}
    finally:
        gate.set()
        breaker.close()


def test_an_operation_done_in_time_ends_the_count():
    gate = threading.Event()
    back = Recording(gate)
    breaker = BreakerStore(back, FAST)
    ids, data = blocks(3, 10)
    try:
        breaker.dump(ids[:1], data[:1])  # hangs: one timeout
        time.sleep(2 * FAST.timeout_s)
        gate.set()
        breaker.wait(breaker.dump(ids[1:2], data[1:2]), 1)  # done in time
        gate.clear()
        breaker.dump(ids[2:], data[2:])  # hangs: one timeout again, not two in a row
        time.sleep(2 * FAST.timeout_s)
        assert not breaker.degraded
    finally:
        gate.set()
        breaker.close()


def test_landed_loads_reach_the_guarded_store(tmp_path):
    ids, data = blocks(2, 4096)
    breaker = BreakerStore(create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}}), FAST)
    try:
        breaker.wait(breaker.dump(ids, data), 10)
        got: dict[int, bytes] = {}
        ok = breaker.wait(breaker.load(ids, [bytearray(4096)] * 2, lambda i, p: bool(got.setdefault(i, bytes(p)))), 10)
        assert ok == [True, True] and got == {0: data[0], 1: data[1]}
    finally:
        breaker.close()
