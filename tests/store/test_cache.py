"""The DRAM tier: LRU within its capacity, read-through fill, write-through and bounded write-back."""

import threading
import time

import pytest

from ucm.store.base import Store, Task
from ucm.store.cache import CacheConfig, CacheStore
from ucm.store.empty import EmptyStore

from .helpers import blocks

pytestmark = pytest.mark.engines  # times things tightly: make test runs it alone (ucm_testing.lanes)


class Recording(Store):
    """A backend that stores in a dict and records calls; a real store (not a mock of one)."""

    backend = "recording"

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.data: dict[bytes, bytes] = {}
        self.loads: list[bytes] = []
        self.gate = gate

    def _lookup(self, ids):
        return [i in self.data for i in ids]

    def _dump(self, ids, payloads):
        task = Task(len(ids))

        def run():
            if self.gate is not None:
                self.gate.wait()
            for i, p in zip(ids, payloads, strict=True):
                self.data[i] = bytes(p)
            task._set(range(len(ids)), [True] * len(ids))

        threading.Thread(target=run).start()
        return task

    def _load(self, ids, buffers):
        ok = []
        for i, b in zip(ids, buffers, strict=True):
            self.loads.append(i)
            if i in self.data and len(self.data[i]) == b.nbytes:
                b[:] = self.data[i]
                ok.append(True)
            else:
                ok.append(False)
        return Task.completed(ok)


def test_capacity_is_respected_and_least_recently_used_goes_first():
    back = Recording()
    cache = CacheStore(CacheConfig(capacity=4 * 1000), back)
    ids, data = blocks(6, 1000)
    cache.wait(cache.dump(ids[:4], data[:4]))
    cache.wait(cache.load(ids[:1], [bytearray(1000)]))  # ids[0] becomes most recent
    cache.wait(cache.dump(ids[4:], data[4:]))
    assert cache.used_bytes <= 4000
    back.loads.clear()
    bufs = [bytearray(1000) for _ in ids]
    assert cache.wait(cache.load(ids, bufs)) == [True] * 6
    assert set(back.loads) == {ids[1], ids[2]}  # evicted: the two least recently used
    assert [bytes(b) for b in bufs] == data


def test_read_through_fills_the_tier():
    back = Recording()
    ids, data = blocks(3, 500)
    back.wait(back.dump(ids, data))
    cache = CacheStore(CacheConfig(capacity=10_000), back)
    cache.wait(cache.load(ids, [bytearray(500) for _ in ids]))
    back.loads.clear()
    bufs = [bytearray(500) for _ in ids]
    assert cache.wait(cache.load(ids, bufs)) == [True] * 3
    assert back.loads == []
    assert [bytes(b) for b in bufs] == data


def test_landed_loads_land_hits_from_memory_and_misses_from_the_backend_filling_the_tier():
    back = Recording()
    ids, data = blocks(3, 500)
    back.wait(back.dump(ids, data))
    cache = CacheStore(CacheConfig(capacity=10_000), back)
    cache.wait(cache.load(ids[:1], [bytearray(500)]))  # ids[0] in memory now
    back.loads.clear()
    got: dict[int, bytes] = {}
    bufs = [bytearray(500) for _ in ids]
    assert cache.wait(cache.load(ids, bufs, lambda i, p: bool(got.setdefault(i, bytes(p))))) == [True] * 3
    assert got == dict(enumerate(data))
    assert back.loads == ids[1:]  # the hit never reached the backend
    back.loads.clear()
    assert cache.wait(cache.load(ids, bufs, lambda i, p: True)) == [True] * 3
    assert back.loads == []  # the misses filled the tier on their way
    assert cache.wait(cache.load(ids, bufs, lambda i, p: False)) == [False] * 3  # refused: not loaded


def test_write_through_completes_only_when_the_backend_has_it():
    gate = threading.Event()
    back = Recording(gate)
    cache = CacheStore(CacheConfig(capacity=10_000), back)
    ids, data = blocks(2, 100)
    task = cache.dump(ids, data)
    assert not task.done()
    gate.set()
    assert cache.wait(task, 5) == [True, True]
    assert set(back.data) == set(ids)


def test_write_back_completes_at_once_and_bounds_pending_bytes():
    gate = threading.Event()
    back = Recording(gate)
    cache = CacheStore(CacheConfig(capacity=10_000, write_mode="back", write_back_max_pending=300), back)
    ids, data = blocks(4, 100)
    task = cache.dump(ids[:3], data[:3])
    assert cache.wait(task, 1) == [True] * 3  # in memory; backend still blocked
    assert back.data == {}
    blocked = threading.Thread(target=lambda: cache.dump(ids[3:], data[3:]))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # 300 bytes pending: the next dump waits
    gate.set()
    blocked.join(5)
    cache.flush()
    assert set(back.data) == set(ids)


def test_write_back_copies_so_callers_may_reuse_their_buffers():
    gate = threading.Event()
    back = Recording(gate)
    cache = CacheStore(CacheConfig(capacity=10_000, write_mode="back"), back)
    buf = bytearray(b"a" * 100)
    ids = [b"k" * 32]
    cache.wait(cache.dump(ids, [buf]))
    buf[:] = b"b" * 100
    gate.set()
    cache.flush()
    assert back.data[ids[0]] == b"a" * 100


def test_lookup_asks_the_backend_only_for_what_memory_lacks():
    cache = CacheStore(CacheConfig(capacity=10_000), EmptyStore())
    ids, data = blocks(2, 10)
    cache.wait(cache.dump(ids[:1], data[:1]))
    assert cache.lookup(ids) == [True, False]


def test_block_bigger_than_the_tier_bypasses_it():
    back = Recording()
    cache = CacheStore(CacheConfig(capacity=100), back)
    ids, data = blocks(1, 1000)
    assert cache.wait(cache.dump(ids, data)) == [True]
    assert cache.used_bytes == 0
    buf = bytearray(1000)
    assert cache.wait(cache.load(ids, [buf])) == [True] and bytes(buf) == data[0]


def dump_within(cache: CacheStore, ids: list[bytes], data: list[bytes], seconds: float) -> Task:
    """``cache.dump`` run on a thread: the test fails, rather than hangs, if it freezes."""
    tasks: list[Task] = []
    caller = threading.Thread(target=lambda: tasks.append(cache.dump(ids, data)), daemon=True)
    caller.start()
    caller.join(seconds)
    assert not caller.is_alive(), f"dump froze for more than {seconds} s"
    return tasks[0]


def test_write_back_to_a_hung_backend_fails_the_dump_at_its_deadline_and_leaves_a_miss():
    """A backend whose writes never finish stands in for a hung NFS or 3FS server (none can be hung
    here). Once the pending bytes are full, a dump waits for room at most write_back_timeout_s, then
    fails: the engine's step goes on, the block counts as not saved, and a read of it is a miss."""
    hung = threading.Event()  # set only to let the test's threads end
    back = Recording(hung)
    config = CacheConfig(capacity=10_000, write_mode="back", write_back_max_pending=200, write_back_timeout_s=0.3)
    cache = CacheStore(config, back)
    ids, data = blocks(4, 100)
    assert cache.wait(dump_within(cache, ids[:2], data[:2], 1), 0) == [True, True]  # pending bytes now full
    try:
        started = time.monotonic()
        assert cache.wait(dump_within(cache, ids[2:3], data[2:3], 2), 0) == [False]
        assert 0.3 <= time.monotonic() - started < 1
        # The backend is still stuck: the next dump fails at once instead of waiting again.
        started = time.monotonic()
        assert cache.wait(dump_within(cache, ids[3:], data[3:], 2), 0) == [False]
        assert time.monotonic() - started < 0.1
        assert cache.lookup(ids[2:]) == [False, False]
        bufs = [bytearray(b"x" * 100) for _ in ids[2:]]
        assert cache.wait(cache.load(ids[2:], bufs), 1) == [False, False]
        # What was accepted is served from memory, the bytes that were dumped.
        accepted = [bytearray(100) for _ in ids[:2]]
        assert cache.wait(cache.load(ids[:2], accepted), 1) == [True, True]
        assert [bytes(b) for b in accepted] == data[:2]
        started = time.monotonic()
        cache.close()  # gives up on the stuck writes after write_back_timeout_s
        assert time.monotonic() - started < 1
    finally:
        hung.set()


def test_write_back_waits_again_once_the_backend_answers():
    gate = threading.Event()
    back = Recording(gate)
    config = CacheConfig(capacity=10_000, write_mode="back", write_back_max_pending=100, write_back_timeout_s=0.2)
    cache = CacheStore(config, back)
    ids, data = blocks(3, 100)
    cache.wait(cache.dump(ids[:1], data[:1]))
    assert cache.wait(dump_within(cache, ids[1:2], data[1:2], 2), 0) == [False]  # timed out: the backend is stuck
    gate.set()
    assert cache.flush(5)
    assert cache.wait(cache.dump(ids[2:], data[2:]), 5) == [True]
    assert cache.flush(5)
    assert set(back.data) == {ids[0], ids[2]}


def test_threads_filling_the_tier_copy_side_by_side_and_room_held_by_fills_is_not_overcommitted(monkeypatch):
    """Fills copy outside the tier's lock (fresh memory page-faults on its first write, and the
    store's I/O threads would otherwise take turns): two fills are inside their copies at once. A
    third fill finding all the room held by those two is skipped, not squeezed in."""
    import ucm.store.cache as cache_module

    inside, finish = threading.Semaphore(0), threading.Event()
    real_copy = cache_module.copy_from_blob

    def copy(dst, src):
        inside.release()
        finish.wait(10)
        real_copy(dst, src)

    monkeypatch.setattr(cache_module, "copy_from_blob", copy)
    cache = CacheStore(CacheConfig(capacity=2 * 1000), Recording())
    ids, data = blocks(3, 1000)
    fills = [
        threading.Thread(target=cache._put, args=(i, memoryview(d))) for i, d in zip(ids[:2], data[:2], strict=True)
    ]
    for t in fills:
        t.start()
    try:
        both = inside.acquire(timeout=10) and inside.acquire(timeout=2)  # the second only if not queued
        if both:
            cache._put(ids[2], memoryview(data[2]))  # no room left that is not being filled: skipped
    finally:
        finish.set()
        for t in fills:
            t.join()
    assert both, "the second fill waited for the first one's copy"
    assert cache.used_bytes == 2000
    bufs = [bytearray(1000) for _ in range(2)]
    assert cache.wait(cache.load(ids[:2], bufs)) == [True, True]
    assert [bytes(b) for b in bufs] == data[:2]
    assert cache.lookup(ids[2:]) == [False]  # neither in the tier nor behind it
