"""Behaviour every store in the registry must share, run against each for real."""

import numpy as np
import pytest

from ucm.store import create_store
from ucm.store.base import Task

from .helpers import blocks, metric

SPECS = [
    "posix",
    "nfs",
    "ds3fs",
    "posix:round_robin",
    "posix:random",
    "nfs:tiered",
    "posix|nfs",
    "cache|posix",
    "cache-back|posix",
    "cache|posix|nfs",
    "mooncake",
    "cache|mooncake",
]


@pytest.fixture(params=SPECS, scope="module")
def store(request, tmp_path_factory):
    # One store per backend for the module (tests use fresh random ids): Mooncake's close takes ~2 s.
    spec, _, placement = request.param.partition(":")
    tmp_path = tmp_path_factory.mktemp(request.param.replace("|", "-").replace(":", "-"))
    config: dict = {"spec": spec.replace("cache-back", "cache")}
    for fs in ("posix", "nfs", "ds3fs"):
        if fs in spec:
            roots = [tmp_path / f"{fs}-a", tmp_path / f"{fs}-b"]
            for root in roots:
                root.mkdir()
            config[fs] = {"roots": [str(r) for r in roots], "io_threads": 4, "placement": placement or "hash"}
            if placement == "tiered":
                config[fs]["fast_capacity"] = "4MiB"
            if f"{fs}|" in spec:  # a fast tier in front of another store
                config[fs]["capacity"] = "4MiB"
    if spec.startswith("cache"):
        config["cache"] = {"capacity": "8MiB", "write_mode": "back" if "back" in spec else "through"}
    if "mooncake" in spec:
        master = request.getfixturevalue("mooncake_master")
        config["mooncake"] = master.store_options(global_segment_size="128MiB", staging_size="4MiB")
    s = create_store(config)
    yield s
    s.close()


def settle(store):
    flush = getattr(store, "flush", None)
    if flush:
        flush()


def test_round_trip_lookup_and_prefix(store):
    ids, data = blocks(6, 64 << 10)
    assert store.lookup(ids) == [False] * 6
    assert store.wait(store.dump(ids[:4], data[:4]), 30) == [True] * 4
    settle(store)
    assert store.lookup(ids) == [True] * 4 + [False] * 2
    assert store.lookup_prefix(ids) == 4
    assert store.lookup_prefix([ids[5], *ids[:4]]) == 0
    bufs = [bytearray(64 << 10) for _ in ids]
    task = store.load(ids, bufs)
    assert store.wait(task, 30) == [True] * 4 + [False] * 2
    assert store.check(task)
    assert [bytes(b) for b in bufs[:4]] == data[:4]


def test_load_into_numpy_views_zero_copy(store):
    ids, data = blocks(3, 32 << 10)
    store.wait(store.dump(ids, data), 30)
    settle(store)
    arena = np.zeros((3, 32 << 10), dtype=np.uint8)
    assert store.wait(store.load(ids, list(arena)), 30) == [True] * 3
    assert [row.tobytes() for row in arena] == data


def test_wrong_buffer_size_is_a_miss_not_a_partial_load(store):
    ids, data = blocks(1, 16 << 10)
    store.wait(store.dump(ids, data), 30)
    settle(store)
    assert store.wait(store.load(ids, [bytearray(8 << 10)]), 30) == [False]


def test_dump_is_idempotent(store):
    ids, data = blocks(2, 4096)
    for _ in range(3):
        assert store.wait(store.dump(ids, data), 30) == [True, True]
    settle(store)
    bufs = [bytearray(4096), bytearray(4096)]
    assert store.wait(store.load(ids, bufs), 30) == [True, True]
    assert [bytes(b) for b in bufs] == data


def test_bad_arguments_are_caller_errors(store):
    with pytest.raises(ValueError, match="pair up"):
        store.dump([b"a"], [])
    with pytest.raises(ValueError, match="writable"):
        store.load([b"a"], [b"read-only"])
    with pytest.raises(TypeError, match="bytes"):
        store.dump(["not-bytes"], [b"x"])


def test_metrics_count_blocks_and_bytes(store):
    backend = store.backend
    before_ok = metric("ucm_store_blocks_total", backend=backend, op="load", result="ok")
    before_bytes = metric("ucm_store_bytes_total", backend=backend, op="load")
    before_hits = metric("ucm_store_lookup_hits_total", backend=backend)
    ids, data = blocks(2, 1000)
    store.wait(store.dump(ids, data), 30)
    settle(store)
    store.lookup(ids)
    store.wait(store.load(ids, [bytearray(1000), bytearray(1000)]), 30)
    assert metric("ucm_store_blocks_total", backend=backend, op="load", result="ok") == before_ok + 2
    assert metric("ucm_store_bytes_total", backend=backend, op="load") == before_bytes + 2000
    assert metric("ucm_store_lookup_hits_total", backend=backend) == before_hits + 2
    assert metric("ucm_store_operation_seconds_count", backend=backend, op="load") > 0


def test_empty_batches_complete_at_once(store):
    assert store.lookup([]) == []
    assert store.wait(store.dump([], []), 10) == []  # at once; 10 s for a loaded machine
    assert isinstance(store.load([], []), Task)


def test_segmented_buffers_round_trip(store):
    """A block's memory may be several segments (e.g. one per layer of a paged KV cache)."""
    ids, data = blocks(3, 48 << 10)
    pieces = [[memoryview(d)[: 16 << 10], memoryview(d)[16 << 10 :]] for d in data]
    assert store.wait(store.dump(ids, pieces), 30) == [True] * 3
    settle(store)
    arena = np.zeros((3, 3, 16 << 10), dtype=np.uint8)  # another segmentation: 3 x 16 KiB
    assert store.wait(store.load(ids, [list(row) for row in arena]), 30) == [True] * 3
    assert [row.tobytes() for row in arena] == data
    wrong = [[bytearray(16 << 10), bytearray(16 << 10)]]  # 32 KiB for a 48 KiB block
    assert store.wait(store.load(ids[:1], wrong), 30) == [False]
    with pytest.raises(ValueError, match=r"buffers\[0\]: an empty list"):
        store.load(ids[:1], [[]])


def test_landed_loads_hand_over_each_loaded_block_once_before_the_task_ends(store):
    """The connector copies each block into the paged cache as it lands; a block missing, of the
    wrong size, whose landing fails or is refused (a load past its deadline) is not loaded."""
    ids, data = blocks(6, 32 << 10)
    store.wait(store.dump(ids[:5], data[:5]), 30)
    settle(store)
    calls: list[int] = []
    landed: dict[int, bytes] = {}

    def land(index: int, payload: memoryview) -> bool:
        calls.append(index)
        if index == 3:
            raise RuntimeError("the copy into the cache failed")
        if index == 4:
            return False
        landed[index] = bytes(payload)
        return True

    bufs = [bytearray(32 << 10) for _ in ids]
    bufs[2] = bytearray(16 << 10)  # wrong size: a miss
    ok = store.wait(store.load(ids, bufs, land), 30)
    assert ok == [True, True, False, False, False, False]
    assert landed == {0: data[0], 1: data[1]}  # landed before the task completed
    assert sorted(calls) == [0, 1, 3, 4]  # once each, and only blocks that loaded
    with pytest.raises(ValueError, match="flat buffers"):
        store.load(ids[:1], [[bytearray(16 << 10), bytearray(16 << 10)]], land)
