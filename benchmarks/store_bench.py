"""Store throughput next to the raw filesystem and memcpy, measured side by side in one run.

For each block size, trials interleave every case so machine noise hits them alike:
- raw baseline: one file per block with plain os.pwrite / os.pread, opened and closed the same
  way, on the same filesystem, with the same threads and the same chunking as the store;
- posix / nfs: the store's dump (checksum, temp file, rename) and load (read, verify);
  posix-noverify: the same with verify_checksum=false (the xxh3 pass is most of the load overhead);
  posix-mac: the same with mac_key_file (a keyed BLAKE3 MAC instead of xxh3, always verified);
- cache (DRAM tier) and mooncake: against a memcpy of the same bytes (their limit).
Loads read what the trial just wrote (page cache for files). Medians over trials; a first,
uncounted trial warms thread pools and memory, and the case order rotates between trials.

    python benchmarks/store_bench.py --quick --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

os.environ.setdefault("GLOG_minloglevel", "2")

from ucm.store import Store, create_store
from ucm_testing.mooncake import MooncakeMaster

GB = 1e9


def chunked(pool: ThreadPoolExecutor, threads: int, n: int, fn: Callable[[int], None]) -> None:
    """Run fn(i) for i < n in `threads` contiguous chunks, as PerBlockStore does."""

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            fn(i)

    futures = [pool.submit(run, n * c // threads, n * (c + 1) // threads) for c in range(threads)]
    for f in futures:
        f.result()


class Raw:
    """The baseline: the same bytes, one file per block, plain pwrite/pread, in the store's layout.

    Same shard directories (created on demand the same way), so the comparison isolates what the
    store adds: checksum, trailer, temporary name and rename, verification."""

    def __init__(self, root: Path, threads: int, fsync: bool) -> None:
        self.root, self.threads, self.fsync = root, threads, fsync
        self.pool = ThreadPoolExecutor(threads)

    def path(self, block_id: bytes) -> str:
        name = block_id.hex()
        return os.path.join(self.root, name[:2], name)

    def write(self, ids: list[bytes], src: list[memoryview]) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC

        def one(i: int) -> None:
            path = self.path(ids[i])
            try:
                fd = os.open(path, flags, 0o644)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, flags, 0o644)
            try:
                os.pwrite(fd, src[i], 0)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

        chunked(self.pool, self.threads, len(ids), one)

    def read(self, ids: list[bytes], dst: list[memoryview]) -> None:
        def one(i: int) -> None:
            fd = os.open(self.path(ids[i]), os.O_RDONLY)
            try:
                os.preadv(fd, [dst[i]], 0)
            finally:
                os.close(fd)

        chunked(self.pool, self.threads, len(ids), one)

    def remove(self, ids: list[bytes]) -> None:
        for block_id in ids:
            os.unlink(self.path(block_id))


def memcpy(dst: list[memoryview], src: list[memoryview]) -> None:
    for d, s in zip(dst, src, strict=True):
        d[:] = s


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def store_case(store: Store, src: list[memoryview], dst: list[memoryview]) -> tuple[float, float]:
    ids = [os.urandom(32) for _ in src]  # fresh ids: an existing block would make dump a no-op
    t_dump = timed(lambda: _all_ok(store.wait(store.dump(ids, src))))
    t_load = timed(lambda: _all_ok(store.wait(store.load(ids, dst))))
    # Free the space untimed, as eviction does in steady state: memory stores then reuse warm pages.
    store.remove(ids)
    return t_dump, t_load


def _all_ok(ok: list[bool]) -> None:
    if not all(ok):
        raise RuntimeError(f"{ok.count(False)} of {len(ok)} blocks failed")


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ucm-store-bench-", dir=args.dir))
    block_sizes = [2 << 20, 256 << 10]
    total = (8 << 20) if args.smoke else (128 << 20) if args.quick else (1 << 30)
    trials = 1 if args.smoke else 5 if args.quick else 9
    rows = []
    master = MooncakeMaster().start() if not args.no_mooncake else None
    try:
        for bs in block_sizes:
            n = total // bs
            src_arena = np.random.randint(0, 256, size=(n, bs), dtype=np.uint8)
            dst_arena = np.zeros_like(src_arena)
            src = [memoryview(r) for r in src_arena]
            dst = [memoryview(r) for r in dst_arena]
            cases = _cases(work, bs, total, args.threads, master, src_arena, dst_arena)
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
            names = list(cases)
            for trial in range(trials + 1):  # trial 0 warms pools and memory; it is not counted
                order = names[trial % len(names) :] + names[: trial % len(names)]  # no case always goes first
                for name in order:
                    case = cases[name]
                    elapsed = case(src, dst)
                    if trial:
                        times[name].append(elapsed)
                    if not np.array_equal(src_arena, dst_arena):
                        raise RuntimeError(f"{name}: loaded bytes differ from what was dumped")
                    dst_arena[:] = 0
                    os.sync()  # one case's writeback must not slow the next
            for name in ("posix", "posix-noverify", "posix-mac", "nfs", "cache", "mooncake"):
                if name not in times:
                    continue
                raw = "raw_fsync" if name == "nfs" else ("memcpy" if name in ("cache", "mooncake") else "raw")
                med = _medians(times[name], total)
                base = _medians(times[raw], total)
                rows.append(
                    {
                        "backend": name,
                        "block_size": bs,
                        "dump_gbps": med[0],
                        "load_gbps": med[1],
                        "raw_write_gbps": base[0],
                        "raw_read_gbps": base[1],
                        "dump_vs_raw": med[0] / base[0],
                        "load_vs_raw": med[1] / base[1],
                        "baseline": "memcpy"
                        if raw == "memcpy"
                        else f"pwrite/pread{' +fsync' if raw == 'raw_fsync' else ''}",
                    }
                )
            for closer in cases.values():
                getattr(closer, "close", lambda: None)()
    finally:
        if master is not None:
            master.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"results": rows, "trials": trials, "bytes_per_case": total, "threads": args.threads}


class _StoreCase:
    def __init__(self, store: Store) -> None:
        self.store = store

    def __call__(self, src: list[memoryview], dst: list[memoryview]) -> tuple[float, float]:
        return store_case(self.store, src, dst)

    def close(self) -> None:
        self.store.close()


def _cases(work: Path, bs: int, total: int, threads: int, master: MooncakeMaster | None, src_arena, dst_arena):
    raw_dir = work / "raw"
    root = work / "posix"
    for d in (raw_dir, root):
        d.mkdir(exist_ok=True)
    raw, raw_fsync = Raw(raw_dir, threads, False), Raw(raw_dir, threads, True)

    def raw_case(r: Raw):
        def case(src: list[memoryview], dst: list[memoryview]) -> tuple[float, float]:
            ids = [os.urandom(32) for _ in src]
            elapsed = timed(lambda: r.write(ids, src)), timed(lambda: r.read(ids, dst))
            r.remove(ids)
            return elapsed

        return case

    def memcpy_case(src, dst):
        scratch = [memoryview(bytearray(bs)) for _ in src]
        return timed(lambda: memcpy(scratch, src)), timed(lambda: memcpy(dst, scratch))

    posix_opts = {"roots": [str(root)], "io_threads": threads}
    mac_key = work / "mac.key"
    mac_key.write_bytes(os.urandom(32))
    cases: dict = {
        "raw": raw_case(raw),
        "posix": _StoreCase(create_store({"spec": "posix", "posix": posix_opts})),
        "posix-noverify": _StoreCase(
            create_store({"spec": "posix", "posix": {**posix_opts, "verify_checksum": False}})
        ),
        "posix-mac": _StoreCase(create_store({"spec": "posix", "posix": {**posix_opts, "mac_key_file": str(mac_key)}})),
        "raw_fsync": raw_case(raw_fsync),
        "nfs": _StoreCase(create_store({"spec": "nfs", "nfs": posix_opts})),
        "memcpy": memcpy_case,
        # The DRAM tier in front of `empty`, so dump and load time only the memory tier.
        "cache": _StoreCase(create_store({"spec": "cache|empty", "cache": {"capacity": 2 * total}})),
    }
    if master is not None:
        segment = 2 * total
        store = create_store({"spec": "mooncake", "mooncake": master.store_options(global_segment_size=segment)})
        store.register_buffer(src_arena)
        store.register_buffer(dst_arena)
        cases["mooncake"] = _StoreCase(store)
    return cases


def _medians(samples: list[tuple[float, float]], total: int) -> tuple[float, float]:
    return (
        total / statistics.median(s[0] for s in samples) / GB,
        total / statistics.median(s[1] for s in samples) / GB,
    )


def print_table(report: dict) -> None:
    head = (
        f"{'backend':<15}{'block':>9}{'dump GB/s':>11}{'load GB/s':>11}{'base w':>9}{'base r':>9}"
        f"{'dump/raw':>10}{'load/raw':>10}  baseline"
    )
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        bs = f"{r['block_size'] >> 10} KiB" if r["block_size"] < (1 << 20) else f"{r['block_size'] >> 20} MiB"
        print(
            f"{r['backend']:<15}{bs:>9}{r['dump_gbps']:>11.2f}{r['load_gbps']:>11.2f}{r['raw_write_gbps']:>9.2f}"
            f"{r['raw_read_gbps']:>9.2f}{r['dump_vs_raw']:>10.2f}{r['load_vs_raw']:>10.2f}  {r['baseline']}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="128 MiB per case, 5 trials (under a minute)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="8 MiB per case, 1 trial: the flow at its smallest (make test), no measurement",
    )
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--threads", type=int, default=4, help="I/O threads for the store and the raw baseline")
    parser.add_argument("--dir", default=None, help="filesystem to measure (default: the temp dir)")
    parser.add_argument("--no-mooncake", action="store_true", help="skip Mooncake (no master binary)")
    args = parser.parse_args()
    report = run(args)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
