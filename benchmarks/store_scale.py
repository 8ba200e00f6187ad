"""What the posix store's capacity accounting and eviction cost as it grows (issue 70's figures).

For each size (blocks of --block-bytes, written through the store into one directory tree):

- ``check_ms``: one capacity check that evicts nothing (the store under its high watermark), the
  median of --repeats after the store's first; bound: reading one small counter file, what a check
  that kept used bytes incrementally would cost (``bound_check_ms``). The first check walks every
  block (no walk recorded yet): ``walk_ms``, what a check costs once per ``usage_walk_interval_s``.
- ``evict_us_per_block``: one pass evicting down to ``evict_to`` of a capacity just below what is
  stored, per block evicted; bound: unlinking the same number of block files with their paths known
  (``bound_evict_us_per_block``). The pass takes the oldest blocks the last walk listed (enough for
  several passes); ``evict_amortized_us_per_block`` adds the walk's share: its cost over the blocks
  it lists.
- ``lookup_us``: a lookup per id, half of them stored; bound: one ``stat`` per id of a stored path.

And once, at the smallest size's scale: the hit rate of the store's eviction order on a Zipf
trace (lookups, loads that refresh recency, writes of misses) against an exact LRU of the same
capacity in blocks, simulated on the same trace (``hit_rate_vs_lru``; the bound is 1.0).

The page cache holds the directories after the writes, as it would on a busy engine host: the
figures are a local disk's best case; over NFS each directory entry read or unlinked is a round
trip more.

    python benchmarks/store_scale.py --json OUT.json                    # 100k and 1M blocks
    python benchmarks/store_scale.py --sizes 100000,1000000,5000000      # where the disk allows
    python benchmarks/store_scale.py --smoke --json OUT.json            # make test's: the flow
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ucm.store.posix import PosixConfig, PosixStore
from ucm_testing.stallfs import StallMount, available

BATCH = 1000


def block_id(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4  # 32 bytes, as a sha256 block id


def fill(root: Path, n: int, block_bytes: int) -> None:
    """``n`` blocks written through a store without a capacity (nothing evicts while filling)."""
    store = PosixStore(PosixConfig(roots=[str(root)], io_threads=8, touch_interval_s=0))
    payload = bytes(block_bytes)
    for lo in range(0, n, BATCH):
        ids = [block_id(i) for i in range(lo, min(n, lo + BATCH))]
        ok = store.dump(ids, [payload] * len(ids)).wait(600)
        assert all(ok), f"{ok.count(False)} blocks not written"
    store.close()


def with_capacity(root: Path, capacity: int) -> PosixStore:
    # A long interval: the background evictor stays out of the timed calls.
    config = PosixConfig(roots=[str(root)], capacity=capacity, eviction_interval_s=3600, touch_interval_s=0)
    return PosixStore(config)


def block_files(root: Path) -> list[os.DirEntry[str]]:
    """The store's block files (its shard directories; not its own bookkeeping under dot names)."""
    shards = [d for d in os.scandir(root) if d.is_dir() and not d.name.startswith(".")]
    return [e for d in shards for e in os.scandir(d.path) if e.is_file()]


def first_block_paths(root: Path, k: int) -> list[str]:
    """``k`` block files' paths, listing no more shards than it takes (through a slow mount too)."""
    paths: list[str] = []
    for shard in sorted(d.path for d in os.scandir(root) if len(d.name) == 2):
        paths += [e.path for e in os.scandir(shard) if not e.name.endswith(".tmp")][: k - len(paths)]
        if len(paths) == k:
            break
    return paths


def stored_bytes(root: Path) -> int:
    return sum(e.stat().st_size for e in block_files(root))


def median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_size(work: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """The figures of one size: on the local disk, or (--fuse-delay-ms) through the FUSE
    passthrough, filled on its backing directory first (filling through it would take hours)."""
    backing = work / f"n{n}"
    backing.mkdir()
    start = time.perf_counter()
    fill(backing, n, args.block_bytes)
    fill_s = time.perf_counter() - start
    used = stored_bytes(backing)  # on the backing directory: a walk through a slow mount takes minutes
    if args.fuse_delay_ms is None:
        figures = measure(backing, n, used, args)
    else:
        mount = StallMount(backing, work / "mnt", work / "flags", work / "stallfs.log", args.fuse_delay_ms / 1e3)
        try:
            figures = measure(mount.start().mountpoint, n, used, args)
        finally:
            mount.stop()
    shutil.rmtree(backing)
    return {"blocks": n, "fill_s": fill_s, **figures}


def measure(root: Path, n: int, used: int, args: argparse.Namespace) -> dict[str, Any]:
    counter = root / ".counter"
    counter.write_text(str(used))

    roomy = with_capacity(root, used * 4)  # far below the high watermark: a check evicts nothing
    start = time.perf_counter()
    roomy.enforce_capacity()  # the store's first check: no walk recorded yet, so it walks
    walk_s = time.perf_counter() - start
    check_s = median_s(roomy.enforce_capacity, args.repeats)
    bound_check_s = median_s(lambda: int(counter.read_text()), args.repeats)
    rng = random.Random(n)
    probe = [block_id(rng.randrange(2 * n)) for _ in range(args.lookups)]  # half stored
    lookup_s = median_s(lambda: roomy.lookup(probe), args.repeats) / len(probe)
    paths = [roomy._paths(block_id(rng.randrange(n)))[0] for _ in range(args.lookups)]
    bound_lookup_s = median_s(lambda: [os.stat(p) for p in paths], args.repeats) / len(paths)
    roomy.close()

    # Just over capacity: one pass evicts down to evict_to (0.9) of it, the oldest blocks first.
    tight = with_capacity(root, int(used / 1.001))
    listed = max(1, min(n, int(4 * (1 - tight.config.evict_to) * n)))  # what a walk lists (PosixStore._walk)
    start = time.perf_counter()
    evicted, _ = tight.enforce_capacity()
    evict_s = time.perf_counter() - start
    tight.close()
    left = first_block_paths(root, max(1, evicted))
    start = time.perf_counter()
    for path in left:
        os.unlink(path)
    bound_evict_s = (time.perf_counter() - start) / len(left)
    return {
        "walk_ms": walk_s * 1e3,
        "check_ms": check_s * 1e3,
        "bound_check_ms": bound_check_s * 1e3,
        "lookup_us": lookup_s * 1e6,
        "bound_lookup_us": bound_lookup_s * 1e6,
        "evicted_blocks": evicted,
        "evict_us_per_block": evict_s / max(1, evicted) * 1e6,
        "evict_amortized_us_per_block": evict_s / max(1, evicted) * 1e6 + walk_s * 1e6 / listed,
        "bound_evict_us_per_block": bound_evict_s * 1e6,
    }


def zipf_trace(distinct: int, requests: int, s: float, seed: int) -> list[int]:
    weights = [1 / (k + 1) ** s for k in range(distinct)]
    order = list(range(distinct))
    random.Random(seed).shuffle(order)  # popularity unrelated to id order
    return [order[k] for k in random.Random(seed + 1).choices(range(distinct), weights, k=requests)]


def lru_hits(trace: list[int], capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key in trace:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def store_hits(work: Path, trace: list[int], capacity_blocks: int, block_bytes: int) -> int:
    """The trace through the store: a hit is loaded (refreshing its recency), a miss written; the
    store checks its capacity as writers do (every share of its write budget)."""
    root = work / "zipf"
    root.mkdir()
    file_bytes = stored_block_bytes(work, block_bytes)
    config = PosixConfig(
        roots=[str(root)], capacity=capacity_blocks * file_bytes, eviction_interval_s=3600, touch_interval_s=0
    )
    store = PosixStore(config)
    payload, buffer = bytes(block_bytes), bytearray(block_bytes)
    hits = 0
    for key in trace:
        bid = block_id(key)
        if store.load([bid], [buffer]).wait(60)[0]:
            hits += 1
        else:
            store.dump([bid], [payload]).wait(60)
    store.close()
    shutil.rmtree(root)
    return hits


def stored_block_bytes(work: Path, block_bytes: int) -> int:
    """A block's file size (payload and trailer)."""
    root = work / "one"
    root.mkdir()
    fill(root, 1, block_bytes)
    size = stored_bytes(root)
    shutil.rmtree(root)
    return size


def report(sizes: list[dict[str, Any]], zipf: dict[str, Any]) -> dict[str, Any]:
    by = {s["blocks"]: s for s in sizes}
    out: dict[str, Any] = {"sizes": sizes, "zipf": zipf, "hit_rate_vs_lru": zipf["hit_rate_vs_lru"]}
    small, large = min(by), max(by)
    out["check_growth"] = by[large]["check_ms"] / by[small]["check_ms"]
    out["evict_growth"] = by[large]["evict_us_per_block"] / by[small]["evict_us_per_block"]
    out["evict_amortized_growth"] = (
        by[large]["evict_amortized_us_per_block"] / by[small]["evict_amortized_us_per_block"]
    )
    if 100_000 in by and 1_000_000 in by:
        out["check_ms_1m"] = by[1_000_000]["check_ms"]
        out["check_growth_1m_vs_100k"] = by[1_000_000]["check_ms"] / by[100_000]["check_ms"]
    return out


def print_report(r: dict[str, Any]) -> None:
    head = (
        f"{'blocks':>10}{'check ms':>11}{'bound':>9}{'walk ms':>10}{'evict us/blk':>14}{'+walk':>11}{'bound':>8}"
        f"{'lookup us':>11}{'bound':>8}"
    )
    print(head)
    for s in r["sizes"]:
        print(
            f"{s['blocks']:>10}{s['check_ms']:>11.3f}{s['bound_check_ms']:>9.3f}{s['walk_ms']:>10.1f}"
            f"{s['evict_us_per_block']:>14.1f}{s['evict_amortized_us_per_block']:>11.1f}"
            f"{s['bound_evict_us_per_block']:>8.1f}{s['lookup_us']:>11.1f}{s['bound_lookup_us']:>8.1f}"
        )
    z = r["zipf"]
    print(f"\nZipf trace ({z['requests']} requests over {z['distinct']} blocks, capacity {z['capacity_blocks']}):")
    print(f"  hit rate: store {z['store_hit_rate']:.3f}, exact LRU {z['lru_hit_rate']:.3f} (the bound)")
    print(f"  hit_rate_vs_lru {r['hit_rate_vs_lru']:.3f}   target >= 0.97")
    print(f"check_growth (largest / smallest size) {r['check_growth']:.1f}   target <= 2")
    print(f"evict_growth (per block, largest / smallest) {r['evict_growth']:.2f}   target <= 2")
    print(f"evict_amortized_growth (the walk's share included) {r['evict_amortized_growth']:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000,1000000", help="comma-separated block counts")
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lookups", type=int, default=10_000)
    parser.add_argument("--zipf-requests", type=int, default=50_000)
    parser.add_argument("--dir", help="where the stores live (default: the system's temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="2,000 and 8,000 blocks, a short trace: the flow")
    parser.add_argument(
        "--fuse-delay-ms",
        type=float,
        help="measure through the FUSE passthrough (ucm_testing.stallfs), each call delayed this long: "
        "0.3 is an NFS round trip (needs make bench-deps: mfusepy)",
    )
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.repeats, args.lookups, args.zipf_requests = "2000,8000", 1, 500, 3000
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="ucm-store-scale-", dir=args.dir))
    try:
        if args.fuse_delay_ms is not None and (why := available()) is not None:
            parser.error(f"--fuse-delay-ms: {why}")
        measured = [measure_size(work, n, args) for n in sizes]
        distinct = max(100, args.zipf_requests // 5)
        capacity = distinct // 5
        trace = zipf_trace(distinct, args.zipf_requests, 0.99, seed=5)
        store = store_hits(work, trace, capacity, args.block_bytes)
        lru = lru_hits(trace, capacity)
        zipf = {
            "requests": len(trace),
            "distinct": distinct,
            "capacity_blocks": capacity,
            "store_hit_rate": store / len(trace),
            "lru_hit_rate": lru / len(trace),
            "hit_rate_vs_lru": store / lru,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {**report(measured, zipf), "fuse_delay_ms": args.fuse_delay_ms}
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
