"""A store that stops answering (an NFS hard mount in an outage, a stuck FUSE mount, a stalled RPC)
never freezes vLLM: lookups answer "miss" at their deadline and stop queueing behind the stuck
call; loads are abandoned at theirs and recomputed, and an abandoned read lands in staging, never
in cache memory vLLM reuses.

No store here can be made to hang for real on demand (the FIFO trick no longer works: block files
are opened non-blocking), so ``Stalled`` stands in: a real POSIX store whose answers are held back
until the test releases them."""

from __future__ import annotations

import threading
import time

from tests.connector.test_scheduler import CTX, Req, put, side
from tests.connector.test_worker import IDS, NB, kv_caches, run_step, worker
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.integration.vllm.stats import StatsRecorder
from ucm.integration.vllm.worker import WorkerSide
from ucm.store import Task, create_store


class Stalled:
    """A real store whose lookups and loads hang until ``release()``."""

    def __init__(self, store) -> None:  # type: ignore[no-untyped-def]
        self.store = store
        self.released = threading.Event()
        self.pending: list[tuple[Task, list]] = []

    def lookup_prefix(self, ids):  # type: ignore[no-untyped-def]
        self.released.wait()
        return self.store.lookup_prefix(ids)

    def load(self, ids, buffers):  # type: ignore[no-untyped-def]
        task = Task(len(ids))
        self.pending.append((task, buffers))
        return task

    def release(self) -> None:
        """The store answers again: the held loads complete, late, with garbage in their buffers."""
        self.released.set()
        for task, buffers in self.pending:
            for b in buffers:
                b[:] = 0xAB
            task._set(range(len(buffers)), [True] * len(buffers))

    def dump(self, ids, payloads):  # type: ignore[no-untyped-def]
        return self.store.dump(ids, payloads)

    def close(self) -> None:
        self.store.close()


def test_a_load_past_its_deadline_is_recomputed_and_its_late_read_lands_nowhere(tmp_path):
    stalled = Stalled(create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}}))
    w = WorkerSide(
        stalled, rank=0, tp_size=1, load_mode="layer", save_mode="layer", stats=StatsRecorder(), load_timeout_s=0.3
    )
    kv = kv_caches(False)
    w.register(kv, NB)
    started = time.monotonic()
    run_step(w, kv, UCMConnectorMetadata(loads=[BlockTransfer("r", IDS[:2], [5, 6])]))
    assert time.monotonic() - started < 2  # the step went on at the deadline
    assert w.take_load_errors() == {5, 6}  # vLLM recomputes them
    assert w._stats.take().data["load_timeouts"] == 1
    stalled.release()  # the abandoned read completes now, after vLLM may have reused the blocks
    assert not any(t.any() for t in kv.values())  # nothing of it reached the cache


def test_without_a_deadline_cpu_loads_go_straight_into_the_cache(tmp_path):
    assert worker(tmp_path)._in_place_option is None
    w = worker(tmp_path)
    w.register(kv_caches(False), NB)
    assert w._in_place
    deadline = WorkerSide(
        create_store({"spec": "empty"}),
        rank=0,
        tp_size=1,
        load_mode="layer",
        save_mode="layer",
        stats=StatsRecorder(),
        load_timeout_s=1.0,
    )
    deadline.register(kv_caches(False), NB)
    assert not deadline._in_place  # staged: an abandoned read must not land in reused cache memory


def test_a_stuck_lookup_is_a_miss_and_later_lookups_do_not_queue_behind_it(tmp_path):
    real = create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}})
    tokens = list(range(16))
    put(real, tokens, 4)
    stalled = Stalled(real)
    s = side(stalled)
    s._lookups.timeout_s = 0.3
    started = time.monotonic()
    assert s.num_new_matched_tokens(Req("a", tokens), 0) == (0, False)  # at the deadline: a miss
    assert time.monotonic() - started < 1
    started = time.monotonic()
    assert s.num_new_matched_tokens(Req("b", tokens), 0) == (0, False)  # still stuck: at once
    assert time.monotonic() - started < 0.1
    stalled.release()
    time.sleep(0.1)
    assert s.num_new_matched_tokens(Req("c", tokens), 0) == (4 * CTX.block_size - 1, False)  # answering again
    real.close()
