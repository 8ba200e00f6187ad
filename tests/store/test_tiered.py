"""Tiers of file stores: placement tiered (the first root fast), round_robin and random
placement, and a file store in front of another in a pipeline."""

from collections import Counter
from pathlib import Path

from ucm.store import create_store
from ucm.store.posix import TRAILER
from ucm.store.tiered import TieredStore

from .helpers import blocks, metric

BLOCK = 64 << 10


def tiered(fast: Path, slow: Path, **opts) -> TieredStore:
    fast.mkdir(exist_ok=True)
    slow.mkdir(exist_ok=True)
    store = create_store({"spec": "nfs", "nfs": {"roots": [str(fast), str(slow)], "placement": "tiered", **opts}})
    assert isinstance(store, TieredStore)
    return store


def files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and len(p.name) == 64]


def loads(backend: str) -> float:
    return metric("ucm_store_blocks_total", backend=backend, op="load", result="ok")


def test_a_hot_block_is_promoted_and_then_served_from_the_fast_tier(tmp_path):
    # Another engine wrote the blocks to the shared (slow) root only.
    (tmp_path / "slow").mkdir()
    other = create_store({"spec": "nfs", "nfs": {"roots": [str(tmp_path / "slow")]}})
    ids, data = blocks(3, BLOCK)
    assert other.wait(other.dump(ids, data)) == [True] * 3
    other.close()
    store = tiered(tmp_path / "fast", tmp_path / "slow")
    assert files(tmp_path / "fast") == []
    promoted, fast_loads = metric("ucm_store_promoted_blocks_total", backend="nfs_fast"), loads("nfs_fast")
    bufs = [bytearray(BLOCK) for _ in ids]
    assert store.wait(store.load(ids, bufs)) == [True] * 3  # from the slow tier
    store.flush()
    assert metric("ucm_store_promoted_blocks_total", backend="nfs_fast") == promoted + 3
    assert len(files(tmp_path / "fast")) == 3
    slow_loads = loads("nfs")
    again = [bytearray(BLOCK) for _ in ids]
    assert store.wait(store.load(ids, again)) == [True] * 3
    assert [bytes(b) for b in again] == data
    assert loads("nfs_fast") == fast_loads + 3  # the second time from the fast tier...
    assert loads("nfs") == slow_loads  # ...and not from the slow one
    store.close()


def test_the_fast_tier_stays_under_its_capacity_and_what_it_drops_stays_behind_it(tmp_path):
    capacity = 10 * (BLOCK + TRAILER.size)
    store = tiered(tmp_path / "fast", tmp_path / "slow", fast_capacity=capacity, touch_interval_s=0)
    written = []
    for _ in range(6):
        ids, data = blocks(8, BLOCK)
        assert store.wait(store.dump(ids, data)) == [True] * 8
        written += zip(ids, data, strict=True)
        store.fast.enforce_capacity()
        assert sum(p.stat().st_size for p in files(tmp_path / "fast")) <= capacity
    assert metric("ucm_store_capacity_bytes", backend="nfs_fast") == capacity
    assert len(files(tmp_path / "slow")) == 48  # every block was written through
    ids = [i for i, _ in written]
    bufs = [bytearray(BLOCK) for _ in ids]
    assert store.wait(store.load(ids, bufs)) == [True] * 48  # dropped from the fast tier: loaded from behind
    assert [bytes(b) for b in bufs] == [d for _, d in written]
    store.close()


def test_a_file_store_in_front_of_another_in_a_pipeline(tmp_path):
    for d in ("local", "shared"):
        (tmp_path / d).mkdir()
    config = {
        "spec": "cache|posix|nfs",
        "cache": {"capacity": "1MiB"},
        "posix": {"roots": [str(tmp_path / "local")], "capacity": "4MiB"},
        "nfs": {"roots": [str(tmp_path / "shared")]},
    }
    store = create_store(config)
    ids, data = blocks(4, BLOCK)
    assert store.wait(store.dump(ids, data)) == [True] * 4
    assert len(files(tmp_path / "local")) == len(files(tmp_path / "shared")) == 4
    store.close()
    # A fresh engine (empty DRAM tier) loads from the local tier without touching the shared one.
    store = create_store(config)
    shared = loads("nfs")
    bufs = [bytearray(BLOCK) for _ in ids]
    assert store.wait(store.load(ids, bufs)) == [True] * 4
    assert [bytes(b) for b in bufs] == data and loads("nfs") == shared
    store.close()


def test_round_robin_spreads_writes_evenly_and_finds_blocks_in_any_root(tmp_path):
    roots = [tmp_path / r for r in "abc"]
    for r in roots:
        r.mkdir()
    options = {"roots": [str(r) for r in roots], "placement": "round_robin"}
    store = create_store({"spec": "posix", "posix": options})
    ids, data = blocks(12, 4096)
    store.wait(store.dump(ids, data))
    assert Counter(p.parents[1].name for r in roots for p in files(r)) == {"a": 4, "b": 4, "c": 4}
    store.close()
    # Blocks another placement put anywhere are found too.
    hashed = create_store({"spec": "posix", "posix": {"roots": options["roots"]}})
    more, more_data = blocks(6, 4096)
    hashed.wait(hashed.dump(more, more_data))
    hashed.close()
    for placement in ("round_robin", "random"):
        store = create_store({"spec": "posix", "posix": {**options, "placement": placement}})
        assert store.lookup(ids + more) == [True] * (len(ids) + len(more))
        assert store.remove(more[:1]) == [True] and store.lookup(more[:1]) == [False]
        more = more[1:]
        store.close()


def test_random_placement_uses_every_root(tmp_path):
    roots = [tmp_path / r for r in "ab"]
    for r in roots:
        r.mkdir()
    store = create_store({"spec": "posix", "posix": {"roots": [str(r) for r in roots], "placement": "random"}})
    ids, data = blocks(40, 1024)
    store.wait(store.dump(ids, data))
    per_root = Counter(p.parents[1].name for r in roots for p in files(r))
    assert sum(per_root.values()) == 40 and min(per_root.values()) >= 5  # P(fewer) < 1e-6
    store.close()
