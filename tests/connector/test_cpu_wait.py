"""vLLM's shared-memory queue with UCM's CPU wait (:mod:`ucm.integration.vllm.cpu_wait`): a reader
that sleeps right after each message is woken by every write, however the writes bunch up.

The queue is vLLM's own (writer and reader in two threads of this process, as an engine core and
its worker are two processes). Its reader sleeps at once here, so a dropped ping would show as a
read that waits for vLLM's 5 s recheck.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from ucm.integration.vllm import cpu_wait

pytestmark = pytest.mark.engines  # times things tightly: make test runs it alone (ucm_testing.lanes)


@pytest.fixture
def sleeping_queue(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.SpinCondition
    monkeypatch.setattr(spin, "__init__", spin.__init__)  # undone after the test
    cpu_wait.install()
    writer = shm_broadcast.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join()
    yield writer, reader
    for q in (reader, writer):
        q.shutdown()


def test_install_makes_readers_sleep_and_the_writer_keep_every_ping(sleeping_queue):
    import zmq

    writer, reader = sleeping_queue
    assert reader._spin_condition.busy_loop_s == 0
    assert writer._spin_condition.local_notify_socket.getsockopt(zmq.SNDHWM) == cpu_wait.PENDING_PINGS
    cpu_wait.install()  # a second run (vLLM may run plugins twice) wraps nothing twice
    from vllm.distributed.device_communicators import shm_broadcast

    assert not getattr(shm_broadcast.SpinCondition.__init__.__wrapped__, "ucm_sleeping", False)


def test_a_sleeping_reader_gets_every_message_without_waiting_for_the_recheck(sleeping_queue):
    writer, reader = sleeping_queue
    rng = random.Random(7)
    gaps = [rng.choice([0, 0, 0.0002, 0.001, 0.02]) for _ in range(300)]
    sent: dict[int, float] = {}

    def write() -> None:
        for i, gap in enumerate(gaps):
            time.sleep(gap)
            sent[i] = time.monotonic()
            writer.enqueue(i)

    thread = threading.Thread(target=write)
    thread.start()
    waits = []
    for i in range(len(gaps)):
        assert reader.dequeue(timeout=30) == i
        waits.append(time.monotonic() - sent[i])
    thread.join()
    assert max(waits) < 1.0, sorted(waits)[-5:]  # vLLM rechecks every 5 s: no read waited for it
