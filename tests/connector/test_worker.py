"""The worker half moving real tensors through a real store, without an engine."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ucm.deploy.ports import free_port
from ucm.hugepages import HUGE_PAGE
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata, rank_keys
from ucm.integration.vllm.stats import StatsRecorder
from ucm.integration.vllm.worker import WorkerSide
from ucm.store import Store, create_store
from ucm.store.base import Task
from ucm_testing.memory import huge_page_bytes, huge_pages_refused

pytestmark = pytest.mark.engines  # times things tightly: make test runs it alone (ucm_testing.lanes)

NB, LAYERS = 16, 3
REPO = Path(__file__).resolve().parents[2]


def kv_caches(fill: bool) -> dict[str, torch.Tensor]:
    make = torch.randn if fill else torch.zeros
    return {f"model.layers.{i}.attn": make(NB, 2, 32, 128) for i in range(LAYERS)}


# How loaded blocks reach the cache: read straight into it (no deadline), landed from the store's
# threads as each read completes (host memory with a deadline), or staged and copied per layer (a
# GPU's path, run here on the CPU).
PATHS = ["in_place", "landed", "staged"]


def loading(w: WorkerSide, path: str) -> WorkerSide:
    """``w``, registered, set to load by ``path``."""
    assert w._in_place == (path == "in_place")
    w._lands = path == "landed"
    return w


def worker(store_root, load_mode="layer", save_mode="layer", in_place=None, **options) -> WorkerSide:
    """``options``: rank, tp_size, shares_per_rank, kv_heads (default: one worker, TP=1), huge_pages."""
    store = create_store({"spec": "posix", "posix": {"roots": [str(store_root)]}})
    return WorkerSide(
        store,
        **({"rank": 0, "tp_size": 1} | options),
        load_mode=load_mode,
        save_mode=save_mode,
        stats=StatsRecorder(),
        in_place_loads=in_place,
    )


def run_step(w: WorkerSide, kv: dict[str, torch.Tensor], meta: UCMConnectorMetadata, report_layers=True) -> None:
    """What vLLM does in one forward: load, then per layer wait-load / compute / save, then step end."""
    w.start_load(meta)
    for name in kv:
        if report_layers:
            w.wait_layer(name)
            w.save_layer(name, meta)
    w.finish_step(meta)


IDS = [bytes([i]) * 32 for i in range(4)]
# New blocks of requests a and b, saved in a step that also loads.
NEW_A, NEW_B = [bytes([7, i]) * 16 for i in range(2)], [bytes([8, i]) * 16 for i in range(2)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("load_mode", "save_mode"), [("layer", "layer"), ("step", "step"), ("layer", "step")])
def test_saved_blocks_load_back_into_other_slots(tmp_path, load_mode, save_mode, path):
    src_kv, dst_kv = kv_caches(True), kv_caches(False)
    producer = worker(tmp_path, load_mode, save_mode)
    producer.register(src_kv, NB)
    run_step(producer, src_kv, UCMConnectorMetadata(saves=[BlockTransfer("r", IDS, [3, 4, 5, 6])]))
    producer.close()
    consumer = worker(tmp_path, load_mode, save_mode, path == "in_place")
    consumer.register(dst_kv, NB)
    loading(consumer, path)
    run_step(consumer, dst_kv, UCMConnectorMetadata(loads=[BlockTransfer("r", IDS, [10, 11, 12, 13])]))
    for name in src_kv:
        assert torch.equal(dst_kv[name][10:14], src_kv[name][3:7])
        assert not dst_kv[name][:10].any()
    assert consumer.take_load_errors() == set()
    stats = consumer._stats.take().data
    assert stats["loaded_blocks"] == 4
    consumer.close()


@pytest.mark.skipif(huge_pages_refused() is not None, reason=str(huge_pages_refused()))
def test_a_host_cache_registered_with_huge_pages_is_on_them_and_loads_as_before(tmp_path):
    """vLLM allocates a host cache as one zeroed buffer viewed per layer and registers it before any
    forward pass: with huge_pages the worker trades the buffer's pages for 2 MiB ones (zeroed as
    before), and blocks land where they did."""
    blocks = 128  # 4 MiB of cache per layer
    src = {name: torch.randn(blocks, *t.shape[1:]) for name, t in kv_caches(False).items()}
    producer = worker(tmp_path)
    producer.register(src, blocks)
    run_step(producer, src, UCMConnectorMetadata(saves=[BlockTransfer("r", IDS, [3, 4, 5, 6])]))
    producer.close()
    buffer = torch.zeros(LAYERS, blocks, *src["model.layers.0.attn"].shape[1:])
    dst = {name: buffer[i] for i, name in enumerate(src)}
    consumer = worker(tmp_path, huge_pages=True)
    consumer.register(dst, blocks)
    run_step(consumer, dst, UCMConnectorMetadata(loads=[BlockTransfer("r", IDS, [100, 101, 102, 103])]))
    assert consumer.take_load_errors() == set()
    for name in src:
        assert torch.equal(dst[name][100:104], src[name][3:7])
        assert not dst[name][:100].any() and not dst[name][104:].any()
    buffer.add_(1.0)  # every page touched: what the engine's writes do over time
    assert huge_page_bytes(buffer) >= 4 * HUGE_PAGE
    consumer.close()


@pytest.mark.parametrize("path", PATHS)
def test_pools_of_different_tp_share_blocks_split_by_the_larger_tp(tmp_path, path):
    """store_tp 2 on both pools: each rank of a TP=2 engine keeps its KV head of a block; a TP=1
    engine keeps and reads the same two shares (one per head) — prefill TP=2 -> decode TP=1 and
    the reverse. A share missing fails the block."""
    full = kv_caches(True)
    per_rank = [{name: t[:, r : r + 1].clone() for name, t in full.items()} for r in (0, 1)]  # TP=2: a head each

    def tp1(kv, in_place=None):
        w = worker(tmp_path, in_place=in_place, rank=0, tp_size=1, shares_per_rank=2, kv_heads=2)
        w.register(kv, NB)
        return w

    def tp2(rank, kv, in_place=None):
        w = worker(tmp_path, in_place=in_place, rank=rank, tp_size=2)
        w.register(kv, NB)
        return w

    for rank in (0, 1):  # TP=2 writes blocks 3..6 under IDS
        w = tp2(rank, per_rank[rank])
        run_step(w, per_rank[rank], UCMConnectorMetadata(saves=[BlockTransfer("r", IDS, [3, 4, 5, 6])]))
        w.close()
    dst = kv_caches(False)
    reader = loading(tp1(dst, path == "in_place"), path)
    run_step(reader, dst, UCMConnectorMetadata(loads=[BlockTransfer("r", IDS, [10, 11, 12, 13])]))
    assert reader.take_load_errors() == set()
    # the two shares read into one staging buffer, back in the pool once (twice: two loads would share it)
    assert len(reader._staging._free) == (path != "in_place")
    for name in full:
        assert torch.equal(dst[name][10:14], full[name][3:7])
        assert not dst[name][:10].any()
    reader.close()

    other = [bytes([9, i]) * 16 for i in range(3)]  # TP=1 writes blocks 0..2 as two shares
    writer = tp1(full)
    run_step(writer, full, UCMConnectorMetadata(saves=[BlockTransfer("r", other, [0, 1, 2])]))
    writer.close()
    for rank in (0, 1):
        got = {name: torch.zeros_like(t) for name, t in per_rank[rank].items()}
        w = loading(tp2(rank, got, path == "in_place"), path)
        run_step(w, got, UCMConnectorMetadata(loads=[BlockTransfer("r", other, [7, 8, 9])]))
        assert w.take_load_errors() == set()
        for name in full:
            assert torch.equal(got[name][7:10], full[name][0:3, rank : rank + 1])
        w.close()

    store = create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}})
    store.remove(rank_keys(other[1:2], 1, 2))  # block 1's second share is lost
    store.close()
    dst = kv_caches(False)
    reader = loading(tp1(dst, path == "in_place"), path)
    run_step(reader, dst, UCMConnectorMetadata(loads=[BlockTransfer("r", other, [7, 8, 9])]))
    assert reader.take_load_errors() == {8}
    reader.close()


@pytest.mark.parametrize("path", PATHS)
def test_failed_blocks_are_reported(tmp_path, path):
    src_kv, dst_kv = kv_caches(True), kv_caches(False)
    producer = worker(tmp_path)
    producer.register(src_kv, NB)
    run_step(producer, src_kv, UCMConnectorMetadata(saves=[BlockTransfer("r", IDS[:3], [0, 1, 2])]))
    producer.close()
    consumer = worker(tmp_path, in_place=path == "in_place")
    consumer.register(dst_kv, NB)
    loading(consumer, path)
    meta = UCMConnectorMetadata(loads=[BlockTransfer("r", [*IDS[:3], b"missing" * 4], [7, 8, 9, 10])])
    run_step(consumer, dst_kv, meta)
    assert consumer.take_load_errors() == {10}
    assert consumer.take_load_errors() == set()  # reported once
    for name in src_kv:
        assert torch.equal(dst_kv[name][7:10], src_kv[name][0:3])
        assert not dst_kv[name][10].any()
    consumer.close()


@pytest.mark.parametrize("path", PATHS)
def test_blocks_computed_over_a_failed_load_are_not_saved(tmp_path, path):
    """Request a's last prompt block fails to load, so the blocks it computes in the same step rest on
    KV that is not its prompt's: they must not reach the store under a's ids, where a later request
    would load them as its prompt's KV. Nor do b's: b may attend over a's blocks through vLLM's
    prefix cache (the worker cannot tell), so a failed load drops the whole step's saves."""
    kv = kv_caches(True)
    producer = worker(tmp_path)
    producer.register(kv, NB)
    run_step(producer, kv, UCMConnectorMetadata(saves=[BlockTransfer("p", IDS[:1], [0])]))
    producer.close()
    w = worker(tmp_path, in_place=path == "in_place")
    w.register(kv, NB)
    loading(w, path)
    mine, theirs = NEW_A, NEW_B
    meta = UCMConnectorMetadata(
        loads=[BlockTransfer("a", [IDS[0], b"missing" * 4], [1, 2])],
        saves=[BlockTransfer("a", mine, [3, 4]), BlockTransfer("b", theirs, [5, 6])],
    )
    run_step(w, kv, meta)
    assert w.take_load_errors() == {2}
    w.close()
    store = create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}})
    assert store.lookup(rank_keys(mine + theirs, 0, 1)) == [False] * 4
    assert w._stats.take().data["save_failed_blocks"] == 4
    w = worker(tmp_path)  # the same step with every load good saves both
    w.register(kv, NB)
    run_step(w, kv, UCMConnectorMetadata(loads=[BlockTransfer("a", IDS[:1], [1])], saves=meta.saves))
    w.close()
    assert store.lookup(rank_keys(mine + theirs, 0, 1)) == [True] * 4
    store.close()


def tp_rank_step(rank: int, port: int, root: str) -> None:
    """One TP=2 rank's step in its own process, agreeing with the other rank over gloo (as vLLM's
    TP group does): both load IDS[:2] for request a, then save a's and b's new blocks."""
    import functools

    import torch.distributed as dist

    from ucm.integration.vllm.worker import or_across

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    w = worker(root, rank=rank, tp_size=2, any_rank=functools.partial(or_across, group=None))
    kv = kv_caches(True)
    w.register(kv, NB)
    mine, theirs = NEW_A, NEW_B
    meta = UCMConnectorMetadata(
        loads=[BlockTransfer("a", IDS[:2], [1, 2])],
        saves=[BlockTransfer("a", mine, [3, 4]), BlockTransfer("b", theirs, [5, 6])],
    )
    run_step(w, kv, meta)
    w.close()
    dist.destroy_process_group()


def two_workers_after_a_lost_share(root: Path, steps: str) -> Store:
    """Workers 0 and 1 of two save IDS[:2]; worker 0's share of IDS[1] is then lost, and ``steps``
    (a function of this module) runs as each worker in a process of its own. Returns the store."""
    kv = kv_caches(True)
    for rank in (0, 1):
        w = worker(root, rank=rank, tp_size=2)
        w.register(kv, NB)
        run_step(w, kv, UCMConnectorMetadata(saves=[BlockTransfer("p", IDS[:2], [0, 1])]))
        w.close()
    store = create_store({"spec": "posix", "posix": {"roots": [str(root)]}})
    assert store.remove(rank_keys(IDS[1:2], 0, 2)) == [True]
    port = free_port()
    call = f"from tests.connector.test_worker import {steps}; {steps}({{}}, {port}, {str(root)!r})"
    workers = [subprocess.Popen([sys.executable, "-c", call.format(r)], cwd=REPO) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in workers] == [0, 0]
    return store


def test_a_load_failing_on_one_tp_rank_keeps_every_rank_from_saving_over_it(tmp_path):
    """Rank 0's share of a's second block is gone, rank 1's loads: rank 1's later layers still saw
    rank 0's missing KV through the all-reduces, so neither rank saves the step's new blocks."""
    store = two_workers_after_a_lost_share(tmp_path, "tp_rank_step")
    mine, theirs = NEW_A, NEW_B
    for rank in (0, 1):
        assert store.lookup(rank_keys(mine + theirs, rank, 2)) == [False] * 4
    store.close()


NEW_C = [bytes([9, i]) * 16 for i in range(2)]


def pp_stage_steps(stage: int, port: int, root: str) -> None:
    """One pipeline stage of two in its own process, as vLLM's PP group (gloo): step 1 loads
    IDS[:2] for request a and saves a's and b's new blocks; step 2 loads IDS[:1] for c and saves
    c's; then LATER steps like step 2. Stage 0 runs steps 1 and 2 before stage 1 starts its first
    (an earlier stage runs ahead and must never wait for a later one), keeps no more sends pending
    than it may run ahead, and stays up until stage 1 is done, as an engine's does."""
    import time

    import torch.distributed as dist

    from ucm.integration.vllm.worker import StageRelay

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=stage, world_size=2)
    ahead, behind = Path(root) / "stage0-done", Path(root) / "stage1-done"
    relay = StageRelay(None, None, 1, in_flight=2) if stage == 0 else StageRelay(None, 0, None, in_flight=2)
    w = worker(root, rank=stage, tp_size=2, stages=relay)
    kv = kv_caches(True)
    w.register(kv, NB)

    def wait_for(done: Path) -> None:
        deadline = time.monotonic() + 60
        while not done.exists():
            assert time.monotonic() < deadline, f"no {done.name}: stage 0 waited for stage 1?"
            time.sleep(0.05)

    def step(meta: UCMConnectorMetadata) -> None:
        run_step(w, kv, meta)
        assert relay.pending <= 2

    c = UCMConnectorMetadata(loads=[BlockTransfer("c", IDS[:1], [7])], saves=[BlockTransfer("c", NEW_C, [8, 9])])
    if stage == 1:
        wait_for(ahead)
    step(
        UCMConnectorMetadata(
            loads=[BlockTransfer("a", IDS[:2], [1, 2])],
            saves=[BlockTransfer("a", NEW_A, [3, 4]), BlockTransfer("b", NEW_B, [5, 6])],
        )
    )
    step(c)
    if stage == 0:
        ahead.touch()
    for _ in range(LATER):
        step(c)
    if stage == 1:
        behind.touch()
    else:
        wait_for(behind)
    w.close()
    dist.destroy_process_group()


LATER = 20


def test_a_load_failing_on_an_earlier_pipeline_stage_keeps_later_stages_from_saving(tmp_path):
    """Stage 0's share of a's second block is gone, stage 1's loads: stage 1 computed its layers
    from stage 0's hidden states over the missing KV, so neither saves that step's new blocks; the
    next step, with no failure, saves on both."""
    store = two_workers_after_a_lost_share(tmp_path, "pp_stage_steps")
    for stage in (0, 1):
        assert store.lookup(rank_keys(NEW_A + NEW_B, stage, 2)) == [False] * 4, stage
        assert store.lookup(rank_keys(NEW_C, stage, 2)) == [True] * 2, stage
    store.close()


def test_layers_never_waited_for_fail_their_loads(tmp_path):
    kv = kv_caches(True)
    w = worker(tmp_path, load_mode="layer")
    w.register(kv, NB)
    run_step(w, kv, UCMConnectorMetadata(saves=[BlockTransfer("r", IDS[:2], [0, 1])]))
    run_step(w, kv, UCMConnectorMetadata(loads=[BlockTransfer("r", IDS[:2], [5, 6])]), report_layers=False)
    assert w.take_load_errors() == {5, 6}
    w.close()


def test_saves_do_not_block_on_the_store_and_survive_buffer_reuse(tmp_path):
    src_kv = kv_caches(True)
    w = worker(tmp_path)
    w.register(src_kv, NB)
    expected = {name: t[0:2].clone() for name, t in src_kv.items()}
    run_step(w, src_kv, UCMConnectorMetadata(saves=[BlockTransfer("r", IDS[:2], [0, 1])]))
    for t in src_kv.values():
        t[0:2] = 0  # vLLM reuses the blocks right after the step
    w.close()  # waits for in-flight dumps
    dst_kv = kv_caches(False)
    r = worker(tmp_path)
    r.register(dst_kv, NB)
    run_step(r, dst_kv, UCMConnectorMetadata(loads=[BlockTransfer("r", IDS[:2], [0, 1])]))
    for name in dst_kv:
        assert torch.equal(dst_kv[name][0:2], expected[name])
    r.close()


class GatedDumps:
    """A store whose dumps reach the real one only once ``gate`` opens (a slow or distant store)."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def dump(self, ids, blobs) -> Task:
        task = Task(len(ids))

        def later() -> None:
            self.gate.wait()
            task._set(range(len(ids)), self.inner.dump(ids, blobs).wait())

        threading.Thread(target=later, daemon=True).start()
        return task


def test_save_staging_is_reused_only_once_the_store_has_written_it(tmp_path):
    """Saves take their staging from the worker's pool (fresh memory page-faults on first touch): a
    save's buffer goes back when its dump is done, never before, so a later save cannot overwrite
    bytes the store is still writing."""
    gate = threading.Event()
    store = GatedDumps(create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}}), gate)
    written_from: list[int] = []  # the address of each dump's first payload: its staging
    dump = store.dump
    store.dump = lambda ids, blobs: written_from.append(blobs[0].ctypes.data) or dump(ids, blobs)
    w = WorkerSide(
        store, rank=0, tp_size=1, load_mode="layer", save_mode="layer", stats=StatsRecorder(), staging_bytes=1 << 30
    )
    kv = kv_caches(True)
    w.register(kv, NB)
    expected = {name: t[0:6].clone() for name, t in kv.items()}
    run_step(w, kv, UCMConnectorMetadata(saves=[BlockTransfer("r", IDS[:2], [0, 1])]))
    run_step(w, kv, UCMConnectorMetadata(saves=[BlockTransfer("r", IDS[2:4], [2, 3])]))  # the first is not written
    assert written_from[0] != written_from[1]
    gate.set()
    deadline = time.monotonic() + 10
    while len(w._staging._free) < 2 and time.monotonic() < deadline:  # both given back once written
        time.sleep(0.01)
    run_step(w, kv, UCMConnectorMetadata(saves=[BlockTransfer("s", NEW_A, [4, 5])]))
    assert written_from[2] in written_from[:2]
    w.close()
    reader = worker(tmp_path)
    got = kv_caches(False)
    reader.register(got, NB)
    run_step(
        reader,
        got,
        UCMConnectorMetadata(loads=[BlockTransfer("r", IDS, [8, 9, 10, 11]), BlockTransfer("s", NEW_A, [12, 13])]),
    )
    assert reader.take_load_errors() == set()
    for name in got:
        assert torch.equal(got[name][8:14], expected[name])
    reader.close()


@pytest.mark.parametrize("pd", [True, False], ids=["pd_prefill", "other"])
def test_a_pd_prefills_step_ends_once_its_blocks_are_in_the_store(tmp_path, pd):
    """The step's end is when vLLM answers the request: a PD prefill's answer promises blocks that
    are in the store (a prefill stopped right after cannot lose them); other saves do not wait."""
    gate = threading.Event()
    store = GatedDumps(create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}}), gate)
    stats = StatsRecorder()
    w = WorkerSide(store, rank=0, tp_size=1, load_mode="layer", save_mode="layer", stats=stats, pd_save_wait_s=10)
    kv = kv_caches(True)
    w.register(kv, NB)
    threading.Timer(0.5, gate.set).start()
    started = time.perf_counter()
    run_step(w, kv, UCMConnectorMetadata(saves=[BlockTransfer("r", IDS[:2], [0, 1], wait=pd)]))
    took = time.perf_counter() - started
    if pd:
        assert took >= 0.5 and store.inner.lookup_prefix(IDS[:2]) == 2
        # The recorded wait starts once the step's own work is done, after the gate's timer did
        # (a clean run once measured 0.2997 s of a 0.3-s gate): most of the gate, never the step.
        assert 0.3 <= stats.take().data["pd_save_wait_seconds"][0] <= took
    else:
        assert took < 0.5 and store.inner.lookup_prefix(IDS[:2]) == 0
    w.close()


def test_a_pd_prefill_waits_for_its_saves_no_longer_than_pd_save_wait_s(tmp_path):
    gate = threading.Event()
    store = GatedDumps(create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}}), gate)
    stats = StatsRecorder()
    w = WorkerSide(store, rank=0, tp_size=1, load_mode="layer", save_mode="layer", stats=stats, pd_save_wait_s=0.2)
    kv = kv_caches(True)
    w.register(kv, NB)
    started = time.perf_counter()
    run_step(w, kv, UCMConnectorMetadata(saves=[BlockTransfer("r", IDS[:2], [0, 1], wait=True)]))
    assert 0.2 <= time.perf_counter() - started < 2
    assert stats.take().data["pd_save_wait_timeouts"] == 1
    gate.set()
    w.close()
    assert store.inner.lookup_prefix(IDS[:2]) == 2  # it landed later
