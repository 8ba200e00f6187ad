"""A store whose I/O never returns (an NFS hard mount in an outage, a stuck FUSE mount) must not
hold the engine's exit: closing waits a bounded time, then the process leaves the stuck threads
behind. Run in a child process, since the point is whether a real interpreter exits."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ucm.store.workers import IOThreads

pytestmark = pytest.mark.engines  # times things tightly: make test runs it alone (ucm_testing.lanes)

# Every read and write hangs for good; the engine-side worker has saves in flight; then it closes.
HUNG_ENGINE = textwrap.dedent(
    """
    import sys, threading, time
    import torch
    import ucm.store.workers as workers
    workers.CLOSE_WAIT_S = 1.0
    from tests.connector.test_worker import IDS, NB, kv_caches, run_step, worker
    from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata

    w = worker(sys.argv[1])
    posix = w._store
    while hasattr(posix, "inner"):  # under the breaker and deadlines, the posix store itself
        posix = posix.inner
    never = threading.Event()
    posix._read_block = lambda *args: never.wait()
    posix._write_block = lambda *args: never.wait()
    kv = kv_caches(False)
    w.register(kv, NB)
    run_step(w, kv, UCMConnectorMetadata(saves=[BlockTransfer("r", IDS[:2], [1, 2])]))
    started = time.monotonic()
    w.close()
    print(f"closed in {time.monotonic() - started:.1f} s", flush=True)
    """
)


def test_an_engine_whose_store_hangs_still_exits(tmp_path):
    """Timed in parts, since the child's imports (torch, vLLM: 15-35 s on a slow machine) and its
    interpreter's finalization (~10 s of gc over vLLM's modules) are not what is checked: close()
    is timed in the child, the exit after it here."""
    child = subprocess.Popen(
        [sys.executable, "-c", HUNG_ENGINE, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        closed = None
        for line in child.stdout:  # until close() is done (or the child ends without it)
            if closed := re.search(r"closed in ([0-9.]+) s", line):
                break
        exited = time.monotonic()
        _, stderr = child.communicate(timeout=120)
        exited = time.monotonic() - exited
    finally:
        child.kill()
    assert child.returncode == 0 and closed, stderr
    assert float(closed.group(1)) < 10  # CLOSE_WAIT_S is 1 s per pool of threads
    assert exited < 60  # the threads left behind do not hold the exit
    assert "left behind at close" in stderr  # and it says so


def test_io_threads_run_calls_in_order_and_close_waits_for_queued_ones():
    threads = IOThreads(1, "t")
    seen: list[int] = []
    futures = [threads.submit(seen.append, i) for i in range(5)]
    assert threads.close(timeout_s=5)
    assert seen == [0, 1, 2, 3, 4]
    assert all(f.done() for f in futures)


def test_io_threads_hand_errors_to_the_future():
    threads = IOThreads(2, "t")
    future = threads.submit(int, "not a number")
    assert isinstance(future.exception(timeout=5), ValueError)
    threads.close()


def test_closing_io_threads_is_bounded_when_a_call_hangs():
    never = threading.Event()
    threads = IOThreads(2, "t")
    threads.submit(never.wait)
    started = time.monotonic()
    assert not threads.close(timeout_s=0.3)
    assert time.monotonic() - started < 2
    never.set()
