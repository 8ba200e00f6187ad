"""The POSIX store under the failures it must survive: crashes, corruption, full disks, races."""

import errno
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ucm.config import ConfigError
from ucm.store import create_store
from ucm.store.posix import TMP_SUFFIX, TRAILER, PosixStore

from .helpers import blocks, metric


def posix(root: Path, **opts) -> PosixStore:
    return create_store({"spec": "posix", "posix": {"roots": [str(root)], **opts}})


def block_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and len(p.name) == 64]


def test_blocks_spread_over_roots_and_shard_dirs(tmp_path):
    roots = [tmp_path / "r0", tmp_path / "r1", tmp_path / "r2"]
    for r in roots:
        r.mkdir()
    store = create_store({"spec": "posix", "posix": {"roots": [str(r) for r in roots]}})
    ids, data = blocks(60, 128)
    assert store.wait(store.dump(ids, data)) == [True] * 60
    counts = [len(block_files(r)) for r in roots]
    assert sum(counts) == 60 and min(counts) > 5
    f = block_files(roots[0])[0]
    assert f.parent.name == f.name[0:2] and f.parent.parent in roots
    assert f.stat().st_size == 128 + TRAILER.size
    store.close()


def test_blocks_are_readable_by_owner_and_group_only(tmp_path):
    """KV reveals the prompts it came from: no world-readable block files or directories."""
    store = posix(tmp_path)
    ids, data = blocks(4, 64)
    old = os.umask(0)  # the modes are the store's own, not an accident of the umask
    try:
        assert store.wait(store.dump(ids, data)) == [True] * 4
    finally:
        os.umask(old)
    for f in block_files(tmp_path):
        assert f.stat().st_mode & 0o777 == 0o640
        assert f.parent.stat().st_mode & 0o777 == 0o750
    store.close()


def test_corrupt_block_is_a_counted_miss_and_is_rewritten(tmp_path):
    store = posix(tmp_path)
    ids, data = blocks(3, 8192)
    store.wait(store.dump(ids, data))
    path = Path(store._paths(ids[1])[0])
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(raw)
    before = metric("ucm_store_corrupt_blocks_total", backend="posix")
    bufs = [bytearray(8192) for _ in ids]
    assert store.wait(store.load(ids, bufs)) == [True, False, True]
    assert metric("ucm_store_corrupt_blocks_total", backend="posix") == before + 1
    assert store.lookup(ids) == [True, False, True]  # removed, so the next dump writes a good copy
    store.wait(store.dump(ids, data))
    assert store.wait(store.load(ids, bufs)) == [True] * 3
    assert bytes(bufs[1]) == data[1]
    store.close()


@pytest.mark.parametrize("damage", ["truncate", "append", "empty", "swap"])
def test_damaged_files_are_never_served(tmp_path, damage):
    store = posix(tmp_path)
    ids, data = blocks(2, 4096)
    store.wait(store.dump(ids, data))
    a, b = Path(store._paths(ids[0])[0]), Path(store._paths(ids[1])[0])
    if damage == "truncate":
        os.truncate(a, 5000)
    elif damage == "append":
        with open(a, "ab") as f:
            f.write(b"x")
    elif damage == "empty":
        os.truncate(a, 0)
    else:  # a whole, valid block file under another block's name
        a.write_bytes(b.read_bytes())
    buf = bytearray(4096)
    assert store.wait(store.load(ids[:1], [buf])) == [False]
    store.close()


KILLED_WRITER = """
import json, os, sys
from ucm.store import create_store
s = create_store(json.loads(sys.argv[1]))
payload = os.urandom(24 << 20)
print("ready", flush=True)
while True:
    s.wait(s.dump([os.urandom(32), os.urandom(32)], [payload, payload]))
    print("stored", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["hash", "tiered"])
def test_sigkill_mid_write_never_leaves_a_readable_torn_block(tmp_path, placement):
    roots = [tmp_path] if placement == "hash" else [tmp_path / "fast", tmp_path / "slow"]
    for root in roots:
        root.mkdir(exist_ok=True)
    config = {"spec": "nfs", "nfs": {"roots": [str(r) for r in roots], "io_threads": 2, "placement": placement}}
    saw_partial_tmp = completed = False
    # Kills come later and later until one landed mid-write and some earlier writer completed a
    # block (on a loaded machine a 24 MiB write can outlast the first delays).
    for attempt in range(20):
        proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, json.dumps(config)], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.15 + 0.05 * attempt)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        completed |= b"stored" in proc.stdout.read()
        tmps = [p for p in tmp_path.rglob(f"*{TMP_SUFFIX}")]
        saw_partial_tmp |= any(p.stat().st_size < (24 << 20) + TRAILER.size for p in tmps)
        if saw_partial_tmp and completed and attempt >= 3:
            break
    assert saw_partial_tmp, "no kill landed mid-write; the test proved nothing"
    assert completed, "the writer completed no block before being killed"
    store = create_store(config)
    assert store.verify() == []  # every tier
    found = list(store.scan())
    assert found
    bufs = [bytearray(24 << 20) for _ in found]
    assert store.wait(store.load([b.block_id for b in found], bufs)) == [True] * len(found)
    store.close()


def test_stale_temp_files_are_removed_by_scan(tmp_path):
    store = posix(tmp_path)
    ids, data = blocks(1, 100)
    store.wait(store.dump(ids, data))
    leftover = Path(store._paths(ids[0])[0] + f".dead{TMP_SUFFIX}")
    leftover.write_bytes(b"partial")
    fresh = Path(store._paths(ids[0])[0] + f".live{TMP_SUFFIX}")
    fresh.write_bytes(b"in progress")
    os.utime(leftover, (time.time() - 7200, time.time() - 7200))
    assert [b.block_id for b in store.scan()] == ids
    assert not leftover.exists() and fresh.exists()
    store.close()


def test_injected_write_error_fails_only_that_block(tmp_path, monkeypatch):
    store = posix(tmp_path, io_threads=1)
    ids, data = blocks(4, 4096)
    real = os.pwritev
    calls = {"n": 0}

    def flaky(fd, bufs, offset):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", flaky)
    assert store.wait(store.dump(ids, data)) == [True, False, True, True]
    assert list(tmp_path.rglob(f"*{TMP_SUFFIX}")) == []
    assert store.lookup(ids) == [True, False, True, True]
    store.close()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_enospc_on_a_full_filesystem_fails_only_the_dumps_that_did_not_fit(tiny_tmpfs):
    store = posix(tiny_tmpfs, io_threads=1)
    ids, data = blocks(8, 200 << 10)
    ok = store.wait(store.dump(ids, data))
    assert 1 <= sum(ok) < 8
    assert list(tiny_tmpfs.rglob(f"*{TMP_SUFFIX}")) == []  # no partial files left behind
    bufs = [bytearray(200 << 10) for _ in ids]
    loaded = store.wait(store.load(ids, bufs))
    assert loaded == ok
    assert all(bytes(b) == d for b, d, good in zip(bufs, data, ok, strict=True) if good)
    store.gc(0)  # space comes back: serving goes on
    assert store.wait(store.dump(ids[:2], data[:2])) == [True, True]
    store.close()


def _dump_same_blocks(root: str, seed: int, barrier) -> None:
    import random

    rnd = random.Random(seed)
    ids = [bytes([i]) * 32 for i in range(32)]
    payloads = [bytes([i]) * (256 << 10) for i in range(32)]
    order = list(range(32))
    rnd.shuffle(order)
    store = create_store({"spec": "posix", "posix": {"roots": [root], "io_threads": 4}})
    barrier.wait()
    ok = store.wait(store.dump([ids[i] for i in order], [payloads[i] for i in order]))
    store.close()
    assert all(ok)


@pytest.mark.slow
def test_eight_processes_dumping_the_same_blocks_leave_them_intact(tmp_path):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(8)
    procs = [ctx.Process(target=_dump_same_blocks, args=(str(tmp_path), i, barrier)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 8
    store = posix(tmp_path)
    assert store.verify() == []
    assert list(tmp_path.rglob(f"*{TMP_SUFFIX}")) == []
    ids = [bytes([i]) * 32 for i in range(32)]
    bufs = [bytearray(256 << 10) for _ in ids]
    assert store.wait(store.load(ids, bufs)) == [True] * 32
    assert all(bytes(b) == bytes([i]) * (256 << 10) for i, b in enumerate(bufs))
    store.close()


def test_eviction_keeps_the_store_under_capacity_and_evicts_lru_first(tmp_path):
    block = 64 << 10
    capacity = 40 * (block + TRAILER.size)
    store = posix(tmp_path, capacity=capacity, touch_interval_s=0, eviction_interval_s=0.05)
    hot_ids, hot = blocks(4, block)
    store.wait(store.dump(hot_ids, hot))
    before = metric("ucm_store_evicted_blocks_total", backend="posix")
    for _ in range(10):
        ids, data = blocks(10, block)
        store.wait(store.dump(ids, data))
        store.wait(store.load(hot_ids, [bytearray(block) for _ in hot_ids]))  # keep them recently used
        store.enforce_capacity()
        assert sum(b.size for b in store.scan()) <= capacity
    assert metric("ucm_store_evicted_blocks_total", backend="posix") > before
    assert metric("ucm_store_capacity_bytes", backend="posix") == capacity
    assert metric("ucm_store_used_bytes", backend="posix") == sum(b.size for b in store.scan())
    assert store.lookup(hot_ids) == [True] * 4
    store.close()


def test_an_entry_that_will_not_go_does_not_stop_eviction(tmp_path, monkeypatch):
    block = 16 << 10
    capacity = 8 * (block + TRAILER.size)
    filler = posix(tmp_path)  # no capacity while filling: nothing is evicted before the test's pass
    ids, data = blocks(12, block)
    filler.wait(filler.dump(ids, data))
    for i, block_id in enumerate(ids):  # oldest first
        os.utime(filler._paths(block_id)[0], (1000 + i, 1000 + i))
    filler.close()
    store = posix(tmp_path, capacity=capacity, eviction_interval_s=3600)
    stuck = {
        store._paths(ids[0])[0]: errno.EBUSY,
        store._paths(ids[1])[0]: errno.EACCES,
        store._paths(ids[2])[0]: errno.ESTALE,
    }
    unlink = os.unlink

    def failing(path, *args, **kwargs):
        if path in stuck:
            raise OSError(stuck[path], os.strerror(stuck[path]), path)
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", failing)
    store.enforce_capacity()
    remaining = {b.block_id for b in store.scan()}
    assert set(ids[:3]) <= remaining  # the three that would not go are still there...
    assert sum(b.size for b in store.scan()) <= capacity * store.config.evict_to + 3 * (block + TRAILER.size)
    assert ids[3] not in remaining and ids[-1] in remaining  # ...and the pass went on past them
    store.close()


def test_what_is_not_a_block_is_skipped_by_scan_and_the_admin_commands(tmp_path):
    store = posix(tmp_path)
    ids, data = blocks(3, 1024)
    store.wait(store.dump(ids, data))
    shard = store._paths(ids[0])[0].rsplit("/", 1)[0]
    Path(shard, "README").write_text("not a block")
    Path(shard, "zz" * 32).write_text("not hex")
    Path(shard, "ab" * 32).mkdir()  # a directory with a block's name
    os.symlink("/etc/hostname", Path(shard, "cd" * 32))
    (tmp_path / "xx").mkdir()
    assert sorted(b.block_id for b in store.scan()) == sorted(ids)
    assert store.verify() == []
    config = tmp_path / "store.yaml"
    config.write_text(f"spec: posix\nposix: {{roots: [{tmp_path}]}}\n")
    for action in (["stats"], ["verify"], ["gc", "--target", "0"]):
        r = subprocess.run(
            [str(Path(sys.executable).parent / "ucm"), "store", *action, "-c", str(config)],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
    assert store.lookup(ids) == [False] * 3  # gc to 0 removed the blocks, and only them
    assert Path(shard, "README").exists() and Path(shard, "ab" * 32).is_dir()
    store.close()


def test_background_eviction_runs_without_being_asked(tmp_path):
    block = 32 << 10
    capacity = 20 * (block + TRAILER.size)
    store = posix(tmp_path, capacity=capacity, eviction_interval_s=0.05)
    for _ in range(6):
        ids, data = blocks(10, block)
        store.wait(store.dump(ids, data))
    deadline = time.monotonic() + 10
    while sum(b.size for b in store.scan()) > capacity and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(b.size for b in store.scan()) <= capacity
    store.close()


def test_loads_racing_eviction_are_whole_or_clean_misses(tmp_path):
    store = posix(tmp_path, io_threads=2)
    ids, data = blocks(8, 256 << 10)
    stop = threading.Event()
    bad: list[str] = []

    def churn():
        while not stop.is_set():
            store.gc(0)
            store.wait(store.dump(ids, data))

    t = threading.Thread(target=churn)
    t.start()
    loads = hits = 0
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        bufs = [bytearray(256 << 10) for _ in ids]
        for ok, buf, want in zip(store.wait(store.load(ids, bufs)), bufs, data, strict=True):
            loads += 1
            hits += ok
            if ok and bytes(buf) != want:
                bad.append("torn")
    stop.set()
    t.join()
    assert not bad
    assert 0 < hits < loads  # both outcomes happened: the race was exercised
    store.close()


def test_nfs_retries_stale_handles(tmp_path, monkeypatch):
    ids, data = blocks(1, 1000)
    nfs = create_store({"spec": "nfs", "nfs": {"roots": [str(tmp_path)], "fsync": False}})
    plain = posix(tmp_path)
    nfs.wait(nfs.dump(ids, data))
    real_open = os.open
    failures = {"left": 0}

    def stale_open(path, flags, *a):
        if failures["left"] and str(path).endswith(ids[0].hex()):
            failures["left"] -= 1
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", stale_open)
    failures["left"] = 1
    assert plain.wait(plain.load(ids, [bytearray(1000)])) == [False]
    failures["left"] = 2
    assert nfs.wait(nfs.load(ids, [bytearray(1000)])) == [True]
    nfs.close()
    plain.close()


def test_nfs_lookups_retry_stale_handles(tmp_path, monkeypatch):
    ids, data = blocks(1, 1000)
    nfs = create_store({"spec": "nfs", "nfs": {"roots": [str(tmp_path)], "fsync": False}})
    nfs.wait(nfs.dump(ids, data))
    real_stat = os.stat
    failures = {"left": 2}

    def stale_stat(path, *a, **kw):
        if failures["left"] and str(path).endswith(ids[0].hex()):
            failures["left"] -= 1
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(os, "stat", stale_stat)
    assert nfs.lookup(ids) == [True] and failures["left"] == 0
    nfs.close()


def test_nfs_defaults_fsync_and_retries():
    from ucm.store.posix import NfsConfig, PosixConfig

    nfs, plain = NfsConfig(roots=["/x"]), PosixConfig(roots=["/x"])
    assert (nfs.fsync, nfs.stale_handle_retries, nfs.direct_io) == (True, 3, False)
    assert (plain.fsync, plain.stale_handle_retries) == (False, 0)


def direct_io_posix(root: Path) -> PosixStore:
    """A posix store reading and writing with O_DIRECT; skipped where pytest's temporary directory
    lies on a filesystem without it (tmpfs), which no test here can change."""
    try:
        return posix(root, direct_io=True)
    except ConfigError as exc:
        pytest.skip(f"this filesystem has no O_DIRECT: {exc}")


def test_fsync_and_direct_io_round_trip(tmp_path):
    store = posix(tmp_path, fsync=True)
    ids, data = blocks(3, 5000)
    assert store.wait(store.dump(ids, data)) == [True] * 3
    store.close()
    direct = direct_io_posix(tmp_path)
    bufs = [bytearray(5000) for _ in ids]
    assert direct.wait(direct.load(ids, bufs)) == [True] * 3
    assert [bytes(b) for b in bufs] == data
    more_ids, more = blocks(3, 12345)
    assert direct.wait(direct.dump(more_ids, more)) == [True] * 3
    direct.close()
    buffered = posix(tmp_path)  # the same format whichever way it was written
    bufs = [bytearray(12345) for _ in more_ids]
    assert buffered.wait(buffered.load(more_ids, bufs)) == [True] * 3
    assert [bytes(b) for b in bufs] == more
    assert buffered.verify() == []
    buffered.close()


def test_direct_io_where_unsupported_is_a_clear_startup_error(tmp_path, monkeypatch):
    # Filesystems without O_DIRECT (older tmpfs, some FUSE mounts) refuse it with EINVAL at open.
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(ConfigError, match=r"posix\.direct_io: .* O_DIRECT"):
        posix(tmp_path, direct_io=True)


def test_missing_root_is_a_clear_startup_error(tmp_path):
    with pytest.raises(ConfigError, match=r"posix\.roots\[1\]: .*does not exist"):
        create_store({"spec": "posix", "posix": {"roots": [str(tmp_path), str(tmp_path / "nope")]}})


def test_unwritable_root_is_a_clear_startup_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs: {r.stderr.decode().strip()}")
    else:
        ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"posix\.roots\[0\]: .*not writable"):
            posix(ro)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(ro)], check=True)


def test_without_checksum_verification_damage_to_the_frame_is_still_caught(tmp_path):
    store = posix(tmp_path, verify_checksum=False)
    ids, data = blocks(2, 4096)
    store.wait(store.dump(ids, data))
    flipped = Path(store._paths(ids[0])[0])
    raw = bytearray(flipped.read_bytes())
    raw[10] ^= 1  # payload bit flip: not hashed on load, by choice
    flipped.write_bytes(raw)
    os.truncate(store._paths(ids[1])[0], 4000)  # truncation: always caught
    assert store.wait(store.load(ids, [bytearray(4096), bytearray(4096)])) == [True, False]
    assert store.verify() == [ids[0]]  # the offline check still hashes
    store.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_what_sits_at_a_blocks_path_and_is_no_file_is_a_prompt_miss(tmp_path, kind):
    """A FIFO at a block's path used to block the load (and the engine's step) forever."""
    store = posix(tmp_path)
    ids, data = blocks(2, 1024)
    store.wait(store.dump(ids[1:], data[1:]))
    path = Path(store._paths(ids[0])[0])
    path.parent.mkdir(exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to(store._paths(ids[1])[0])  # even a link to a good block is not followed
    else:
        path.mkdir()
    result: list[list[bool]] = []
    loader = threading.Thread(target=lambda: result.append(store.wait(store.load(ids[:1], [bytearray(1024)]))))
    loader.start()
    loader.join(10)
    assert not loader.is_alive(), "the load hung"
    assert result == [[False]]
    if kind != "directory":
        assert not path.exists() and not path.is_symlink()  # removed, so a dump can write the block
    store.close()


@pytest.mark.parametrize("direct_io", [False, True])
def test_a_load_buffer_of_the_wrong_size_is_a_miss_that_keeps_the_block(tmp_path, direct_io):
    store = posix(tmp_path)
    ids, data = blocks(1, 5000)
    store.wait(store.dump(ids, data))
    store.close()
    store = direct_io_posix(tmp_path) if direct_io else posix(tmp_path)
    assert store.wait(store.load(ids, [bytearray(4000)])) == [False]
    assert Path(store._paths(ids[0])[0]).exists()  # the caller's mistake, not a corrupt block
    buf = bytearray(5000)
    assert store.wait(store.load(ids, [buf])) == [True] and bytes(buf) == data[0]
    store.close()


def test_a_block_swapped_for_a_fifo_while_it_is_read_does_not_block_the_load(tmp_path, monkeypatch):
    """The size check used to open the path a second time: a FIFO put there in between blocked
    the load, and the engine step with it, forever."""
    store = posix(tmp_path)
    ids, data = blocks(1, 1024)
    store.wait(store.dump(ids, data))
    path = store._paths(ids[0])[0]
    os.truncate(path, 900)
    real_fstat = os.fstat

    def fstat_then_swap(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        if os.path.isfile(path):
            os.unlink(path)
            os.mkfifo(path)
        return st

    monkeypatch.setattr(os, "fstat", fstat_then_swap)
    result: list[list[bool]] = []
    loader = threading.Thread(target=lambda: result.append(store.wait(store.load(ids, [bytearray(1024)]))))
    loader.start()
    loader.join(10)
    hung = loader.is_alive()
    if hung:  # let the blocked open go, so that the test process can end
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        loader.join(10)
    assert not hung, "the load hung on the FIFO"
    assert result == [[False]]
    monkeypatch.undo()
    store.close()


def test_with_a_mac_key_only_blocks_written_with_the_key_are_loaded(tmp_path):
    """A checksum detects corruption, not forgery: whoever can write a shared store could plant
    KV for a prompt it can guess. With a key, such a block is a miss."""
    (tmp_path / "kv").mkdir()
    (tmp_path / "key").write_bytes(b"k" * 32)
    (tmp_path / "other").write_bytes(b"o" * 32)
    keyed = posix(tmp_path / "kv", mac_key_file=str(tmp_path / "key"))
    ids, data = blocks(3, 64)
    assert keyed.wait(keyed.dump(ids[:1], data[:1])) == [True]
    buf = [bytearray(64)]
    assert keyed.wait(keyed.load(ids[:1], buf)) == [True] and bytes(buf[0]) == bytes(data[0])

    unkeyed = posix(tmp_path / "kv")  # a writer without the key: checksum only
    assert unkeyed.wait(unkeyed.dump(ids[1:2], data[1:2])) == [True]
    assert keyed.wait(keyed.load(ids[1:2], [bytearray(64)])) == [False]
    other = posix(tmp_path / "kv", mac_key_file=str(tmp_path / "other"))  # the wrong key
    assert other.wait(other.dump(ids[2:3], data[2:3])) == [True]
    assert keyed.wait(keyed.load(ids[2:3], [bytearray(64)])) == [False]
    assert keyed.verify() == []  # the bad ones were removed on load; what is left verifies
    for s in (keyed, unkeyed, other):
        s.close()


def test_a_short_mac_key_is_refused(tmp_path):
    (tmp_path / "key").write_bytes(b"short")
    with pytest.raises(ConfigError, match=r"mac_key_file: .* holds 5 bytes; at least 16 are needed"):
        posix(tmp_path, mac_key_file=str(tmp_path / "key"))
