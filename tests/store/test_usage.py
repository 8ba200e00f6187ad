"""The posix store's used bytes kept in the writers' ledgers (ucm.store.usage): a capacity check that
evicts nothing walks no block, and the count stays true across processes, evictions and kills."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ucm.store.posix import PosixStore
from ucm.store.usage import DIRECTORY, STOPPED_AFTER_S

from . import test_posix
from .helpers import blocks, metric

BLOCK = 16 << 10
FILE = BLOCK + 32  # a block's file: payload and trailer
# Room enough that no writer's share of the write budget runs out (a check of its own) within a test.
ROOMY = 10_000 * FILE


def posix(root: Path, **opts) -> PosixStore:
    """A store whose background evictor stays out of the tests' own checks."""
    return test_posix.posix(root, **{"eviction_interval_s": 3600, **opts})


def walked(store: PosixStore) -> int:
    return sum(b.size for b in store.scan())


def no_walks(store: PosixStore, monkeypatch) -> None:
    def walk():
        raise AssertionError("a capacity check walked the store's blocks")

    monkeypatch.setattr(store, "_scan_entries", walk)


def test_a_check_that_evicts_nothing_reads_the_ledgers_not_the_blocks(tmp_path, monkeypatch):
    filler = posix(tmp_path)  # written before any capacity: no ledger, as a store of an older release
    filler.wait(filler.dump(*blocks(20, BLOCK)))
    filler.close()
    store = posix(tmp_path, capacity=ROOMY)
    assert store.enforce_capacity() == (0, 0)  # the first check walks: nothing is recorded yet
    assert metric("ucm_store_used_bytes", backend="posix") == walked(store)

    more_ids, more = blocks(10, BLOCK)
    store.wait(store.dump(more_ids, more))
    store.remove(more_ids[:3])
    no_walks(store, monkeypatch)
    assert store.enforce_capacity() == (0, 0)
    monkeypatch.undo()
    assert metric("ucm_store_used_bytes", backend="posix") == walked(store)
    store.close()


def test_writers_in_other_processes_count_in_the_check(tmp_path, monkeypatch):
    store = posix(tmp_path, capacity=ROOMY)
    store.enforce_capacity()  # the walk recorded, over an empty store
    other = posix(tmp_path, capacity=ROOMY)  # another engine: its own ledger
    other.wait(other.dump(*blocks(7, BLOCK)))
    other.close()  # flushed on close; a live writer flushes at least once a second
    no_walks(store, monkeypatch)
    store.enforce_capacity()
    monkeypatch.undo()
    assert metric("ucm_store_used_bytes", backend="posix") == walked(store) > 0
    store.close()


def test_a_check_over_the_high_watermark_walks_and_evicts_then_counts_what_it_removed(tmp_path):
    store = posix(tmp_path, capacity=40 * FILE, io_threads=2)
    for _ in range(6):
        store.wait(store.dump(*blocks(10, BLOCK)))
        store.enforce_capacity()
        # A writer's own check (its share of the write budget spent) may walk while its other I/O
        # thread renames a block into place: that one block counts twice until the next walk.
        assert walked(store) <= store._usage.used() <= walked(store) + FILE
        assert walked(store) <= 40 * FILE
    store.close()


def test_a_walk_corrects_what_the_ledgers_missed_within_its_interval(tmp_path):
    store = posix(tmp_path, capacity=ROOMY, usage_walk_interval_s=0.2)
    ids, data = blocks(10, BLOCK)
    store.wait(store.dump(ids, data))
    store.enforce_capacity()
    os.unlink(next(p for p in tmp_path.rglob(ids[0].hex())))  # removed by hand: no ledger sees it
    assert store._usage.used() == walked(store) + FILE
    time.sleep(0.3)
    store.enforce_capacity()
    assert store._usage.used() == walked(store)
    store.close()


def test_a_stopped_writers_ledger_is_folded_into_the_walk(tmp_path):
    old = posix(tmp_path, capacity=ROOMY)
    old.wait(old.dump(*blocks(5, BLOCK)))
    old.close()
    ledger = tmp_path / DIRECTORY / old._usage.name
    gone = time.time() - STOPPED_AFTER_S - 1
    os.utime(ledger, (gone, gone))
    store = posix(tmp_path, capacity=ROOMY)
    store.enforce_capacity()
    assert not ledger.exists()
    assert store._usage.used() == walked(store) == 5 * FILE
    store.close()


WRITER = """
import json, os, sys
from ucm.store import create_store
store = create_store(json.loads(sys.argv[1]))
payload = os.urandom(16 << 10)
print("ready", flush=True)
for _ in range(int(sys.argv[2])):
    store.wait(store.dump([os.urandom(32) for _ in range(4)], [payload] * 4))
    store.enforce_capacity()
store.close()
"""


def test_used_bytes_stay_within_one_percent_of_a_walk_after_writers_evict_and_are_killed(tmp_path):
    """Four writer processes over one store smaller than what they write: they evict each other's
    blocks; two are SIGKILLed mid-run. A new instance's count, from the ledgers alone, is within 1%
    of a full walk (a killed writer loses at most a thousandth of the capacity)."""
    capacity = 600 * FILE
    config = {"spec": "posix", "posix": {"roots": [str(tmp_path)], "capacity": capacity, "eviction_interval_s": 0.2}}

    def writer(dumps: int) -> subprocess.Popen:
        argv = [sys.executable, "-c", WRITER, json.dumps(config), str(dumps)]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    killed = [writer(1_000_000) for _ in range(2)]  # write until killed
    finishing = [writer(120) for _ in range(2)]
    for proc in killed + finishing:
        assert proc.stdout.readline().strip() == b"ready", proc.stderr.read().decode()
    time.sleep(2.0)
    for proc in killed:
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL, proc.stderr.read().decode()  # killed mid-run, not done
    for proc in finishing:
        assert proc.wait(300) == 0, proc.stderr.read().decode()
    store = posix(tmp_path, capacity=capacity)
    counted, actual = store._usage.used(), walked(store)
    assert counted is not None, "no walk recorded: the writers never checked their capacity"
    assert actual <= capacity
    assert abs(counted - actual) <= 0.01 * actual, (counted, actual)
    store.close()


def test_a_pass_evicts_the_walks_oldest_blocks_without_walking_again(tmp_path, monkeypatch):
    store = posix(tmp_path, capacity=100 * FILE, touch_interval_s=0)
    monkeypatch.setattr(store, "_check_every_bytes", 1 << 60)  # no check but the test's own
    old_ids, old = blocks(40, BLOCK)
    store.wait(store.dump(old_ids, old))
    store.enforce_capacity()  # the walk: the 40 blocks are the oldest it lists
    store.wait(store.load(old_ids[:5], [bytearray(BLOCK) for _ in range(5)]))  # refreshed: young again
    new_ids, new = blocks(60, BLOCK)
    store.wait(store.dump(new_ids, new))  # over the high watermark (95 blocks' worth)
    no_walks(store, monkeypatch)
    n, freed = store.enforce_capacity()
    monkeypatch.undo()
    assert walked(store) == 100 * FILE - freed <= 90 * FILE  # down to evict_to
    assert store.lookup(old_ids[:5]) == [True] * 5  # refreshed after the walk: not evicted
    assert store.lookup(old_ids[5:]).count(False) == n == 10  # the oldest, and only as many as needed
    assert store.lookup(new_ids) == [True] * 60
    store.close()


def test_when_the_walks_oldest_blocks_run_out_a_pass_walks_again(tmp_path, monkeypatch):
    store = posix(tmp_path, capacity=100 * FILE)
    monkeypatch.setattr(store, "_check_every_bytes", 1 << 60)  # no check but the test's own
    store.wait(store.dump(*blocks(5, BLOCK)))
    store.enforce_capacity()  # the walk lists 5 blocks, not enough for the pass below
    store.wait(store.dump(*blocks(95, BLOCK)))
    n, freed = store.enforce_capacity()
    assert n == 10 and walked(store) == 100 * FILE - freed <= 90 * FILE
    assert store._usage.used() == walked(store)
    store.close()


def test_a_damaged_list_of_oldest_blocks_costs_a_walk_not_the_pass(tmp_path, monkeypatch):
    store = posix(tmp_path, capacity=100 * FILE)
    monkeypatch.setattr(store, "_check_every_bytes", 1 << 60)  # no check but the test's own
    store.wait(store.dump(*blocks(50, BLOCK)))
    store.enforce_capacity()
    (tmp_path / DIRECTORY / "oldest").write_bytes(b"not a line\n\xff\xfe\n1.5 x /nowhere\n")
    store.wait(store.dump(*blocks(50, BLOCK)))
    n, freed = store.enforce_capacity()
    assert freed == 10 * FILE
    assert n == 10 and walked(store) == 90 * FILE == store._usage.used()
    store.close()
