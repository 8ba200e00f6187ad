"""The worker half of the connector: bytes between the paged KV cache and the store.

Loads start when the step starts (``start_load``). Without a deadline, on the CPU, the store reads
each block straight into the paged cache, one segment per layer. With one (``load_timeout_s``, the
default), a read must never land in cache memory after its deadline, when vLLM may already be
recomputing those blocks: in host memory the store hands each block over as its read completes and
it is copied into every layer (a :class:`Landing`, closed at the deadline) — by the I/O thread that
read it, while the next block is read, for a POSIX store; from the DRAM tier's memory for its hits;
once the whole load is in staging for other stores. On a GPU, blocks are staged in host memory and
copied into each layer just before that layer's attention runs (``load_mode: layer``) or all at once
(``step``). Past the deadline, or when vLLM never waited for the load, the blocks are recomputed and
the read is abandoned — into staging or the store's own memory, which the pending read keeps alive.
While an abandoned read has not finished, the store is not answering reads: new loads are not
started, their blocks are recomputed at once (another read would hold the next step as long; the
store breaker, which would skip the store too, learns of a timeout only after the step that met it
has ended). Saves copy each layer's new blocks into host staging as the layer finishes (``save_mode:
layer``) or at the step's end, then the store writes them in the background: the step waits for the
copies, not for the I/O. Staging is the connector's own memory, so vLLM may free or reuse the blocks
right after the step; it comes from one pool for loads, saves and Blend's reads, back in it once
the store has written (or read) it, because fresh memory page-faults on every first touch.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ucm import metrics
from ucm.hugepages import reback_zeroed, thp_mode, thp_refused
from ucm.integration.vllm.config import BlendConfig
from ucm.integration.vllm.layout import KVLayout
from ucm.integration.vllm.metadata import BlendTransfer, BlockTransfer, UCMConnectorMetadata, rank_keys
from ucm.integration.vllm.staging import StagingPool
from ucm.integration.vllm.stats import StatsRecorder
from ucm.sparse.serving import invalidate_summaries, offloading_runtimes
from ucm.store import Store, Task, workers

logger = logging.getLogger(__name__)


def or_across(flag: bool, group: object) -> bool:
    """``flag`` ORed over the ranks of a ``torch.distributed`` process ``group``."""
    t = torch.tensor([flag], dtype=torch.int32)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(t.item())


class StageRelay:
    """A flag handed down the pipeline-parallel stages, each stage to the next, once per step.

    A load that fails on an earlier stage reaches a later stage's KV through the hidden states it
    is given, while that stage's own loads succeed: the later stage must hear of it before saving.
    A stage sends at the end of its part of a step and never waits for a later stage (an all-reduce
    over the stages would make every stage wait for the slowest). With vLLM's V1 model runner (its
    CPU engines) a stage ends its part before it sends the step's hidden states on, so the next
    stage's receive finds the flag there; with the V2 runner the earlier stages end theirs once the
    last stage has sampled, which it does before ending its own. vLLM's own messages on the same
    group use tag 0: ours keep to ``TAG``."""

    TAG = 0x55434D  # "UCM"

    def __init__(self, group: object, previous: int | None, following: int | None, in_flight: int) -> None:
        """``previous`` / ``following``: the global ranks of the neighbouring stages (None at the ends);
        ``in_flight``: more steps than a stage can run ahead of the next."""
        self._group = group
        self._previous = previous
        self._following = following
        self._in_flight = in_flight
        # Gloo reports a send complete only once waited for: the oldest are waited for (long since
        # received, so at once) to keep this to in_flight sends.
        self._sending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()

    @classmethod
    def of(cls, pp_group: Any) -> StageRelay:
        """This worker's place in vLLM's pipeline-parallel group (its CPU group: gloo)."""
        return cls(
            pp_group.cpu_group,
            None if pp_group.is_first_rank else pp_group.prev_rank,
            None if pp_group.is_last_rank else pp_group.next_rank,
            # vLLM keeps at most one batch per stage in flight (its batch queue), one more with async scheduling
            in_flight=pp_group.world_size + 2,
        )

    @property
    def pending(self) -> int:
        return len(self._sending)

    def relay(self, failed: bool, agree: Callable[[bool], bool] | None = None) -> bool:
        """This stage's ``failed`` ORed with every earlier stage's, ``agree``-d across the stage's own
        tensor-parallel ranks, and handed on to the next stage."""
        if self._previous is not None:
            earlier = torch.zeros(1, dtype=torch.int32)
            torch.distributed.recv(earlier, src=self._previous, group=self._group, tag=self.TAG)
            failed = failed or bool(earlier.item())
        if agree is not None:
            failed = agree(failed)
        if self._following is not None:
            while len(self._sending) >= self._in_flight:
                self._sending.popleft()[0].wait()
            flag = torch.tensor([failed], dtype=torch.int32)
            work = torch.distributed.isend(flag, dst=self._following, group=self._group, tag=self.TAG)
            self._sending.append((work, flag))
        return failed


class Landing:
    """Copies each block of one load into the paged cache as the store hands it over (on the
    store's threads) until :meth:`close`: once that returns, no copy of this load can reach the
    cache, so vLLM may recompute into those blocks at once."""

    def __init__(self, layout: KVLayout, block_ids: list[int]) -> None:
        self._layout = layout
        self._block_ids = block_ids
        self._cond = threading.Condition()
        self._copying = 0
        self._closed = False

    def __call__(self, index: int, payload: memoryview) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._copying += 1
        try:
            self._layout.scatter_block(self._block_ids[index], payload)
        finally:
            with self._cond:
                self._copying -= 1
                self._cond.notify_all()
        return True

    def close(self) -> None:
        """Refuse further copies and wait for the ones running (one block each, at most)."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._copying == 0)


@dataclass(frozen=True)
class Share:
    """One share of every block that this worker keeps in the store under its own keys: its index
    among ``of`` shares (the keys' suffix), and where it lies in the paged cache."""

    index: int
    of: int
    layout: KVLayout


@dataclass
class _Save:
    transfer: BlockTransfer
    buffer: torch.Tensor  # pooled: a row per block, every share's columns
    views: list[torch.Tensor]  # per share (in WorkerSide._shares' order), its columns of the rows


def share_columns(buffer: torch.Tensor, n: int, layout: KVLayout, j: int) -> torch.Tensor:
    """The first ``n`` rows of ``buffer``'s columns for share ``j`` (shares of ``layout.block_bytes``
    each, side by side in a row)."""
    return buffer[:n, j * layout.block_bytes : (j + 1) * layout.block_bytes]


@dataclass
class _Load:
    transfer: BlockTransfer
    share: Share
    staging: torch.Tensor | None  # None: the blocks reach the paged cache without a scatter
    task: Task
    started: float
    ok: list[bool] | None = None
    buffer: torch.Tensor | None = None  # the pooled buffer ``staging`` is a view of
    landing: Landing | None = None


class WorkerSide:
    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        tp_size: int,
        load_mode: str,
        save_mode: str,
        stats: StatsRecorder,
        load_timeout_s: float | None = None,
        staging_bytes: int = 0,
        in_place_loads: bool | None = None,
        pd_save_wait_s: float = 0.0,
        blend: BlendConfig | None = None,
        shares_per_rank: int = 1,
        kv_heads: int = 0,
        any_rank: Callable[[bool], bool] | None = None,
        stages: StageRelay | None = None,
        huge_pages: bool = False,
    ) -> None:
        """``rank`` of ``tp_size`` workers; each keeps ``shares_per_rank`` shares of a block in the
        store (more than one when the store splits blocks by a larger TP than the engine's), each
        share an equal range of this worker's ``kv_heads`` KV heads. ``any_rank`` ORs a flag across
        the tensor-parallel ranks that compute together (a collective: every rank calls it in the
        same step), so that a load failing on one rank keeps every rank from saving over it;
        ``stages`` hands that verdict on from each pipeline stage to the next. ``huge_pages``: a host
        KV cache and sparse off-load's arena go on 2 MiB pages (:mod:`ucm.hugepages`)."""
        self._store = store
        self._huge_pages = huge_pages
        self._blend_config = blend
        self._blender = None
        self._load_timeout_s = load_timeout_s
        self._pd_save_wait_s = pd_save_wait_s
        self._staging_bytes = staging_bytes
        # None: whenever the layout allows it and no deadline can abandon a read in flight
        self._in_place_option = in_place_loads
        self._rank = rank
        self._tp_size = tp_size
        self._shares_per_rank = shares_per_rank
        self._kv_heads = kv_heads
        self._any_rank = any_rank
        self._stages = stages
        self._shares: list[Share] = []
        self._load_mode = load_mode
        self._save_mode = save_mode
        self._stats = stats
        self.layout: KVLayout | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._loads: list[_Load] = []
        self._abandoned: list[Task] = []  # reads past their deadline, not finished yet
        self._scattered: set[int] = set()
        self._load_errors: set[int] = set()
        self._saves: list[_Save] = []
        self._saved_layers = 0
        self._inflight: set[Task] = set()
        self._inflight_lock = threading.Lock()
        self._store_counters = {
            "store_corrupt_blocks": metrics.STORE_CORRUPT_BLOCKS,
            "store_evicted_blocks": metrics.STORE_EVICTED_BLOCKS,
            "store_skipped_blocks": metrics.STORE_SKIPPED_BLOCKS,
        }
        self._store_seen = dict.fromkeys(self._store_counters, 0.0)
        self._fetched_seen = 0  # SparseRuntime.fetched, summed, as last forwarded

    def collect_store_counters(self) -> None:
        """The store's own counters live in this process, which vLLM's /metrics does not read:
        forward their increase with the connector's stats."""
        for key, counter in self._store_counters.items():
            total = metrics.counter_total(counter)
            self._stats.add(key, int(total - self._store_seen[key]))
            self._store_seen[key] = total

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        # First: nothing has written to the cache or kept its address yet. A CPU engine's only: a GPU
        # engine may register host tensors the device copies through (vLLM's HiSparse).
        if self._huge_pages and all(t.device.type == "cpu" for t in kv_caches.values()):
            refused = thp_refused()
            if refused:
                logger.info("UCM: the host KV cache stays on 4 KiB pages: %s", refused)
            else:
                moved = reback_zeroed(kv_caches.values())
                if moved:
                    logger.info(
                        "UCM: %d MiB of host KV cache asked onto 2 MiB pages (transparent_hugepage: %s)",
                        moved >> 20,
                        thp_mode(),
                    )
        self.layout = KVLayout(kv_caches, num_blocks)
        self._kv_caches = kv_caches
        for runtime in offloading_runtimes():
            runtime.allocate_arena(kv_caches, huge_pages=self._huge_pages)
        k, of = self._shares_per_rank, self._tp_size * self._shares_per_rank
        if k == 1:
            self._shares = [Share(self._rank, of, self.layout)]
        else:
            layouts = [self.layout.head_share(self._kv_heads, k, j) for j in range(k)]
            self._shares = [Share(self._rank * k + j, of, layout) for j, layout in enumerate(layouts)]
        rows = 0 if self._in_place_option or self._load_timeout_s is None else self._staging_rows()
        self._staging = StagingPool(self.layout.new_staging, self._staging_bytes, rows)
        if self._blend_config is not None:
            from ucm.integration.vllm.blend import Blender
            from ucm.integration.vllm.blend_model import built_model

            self._blender = Blender(
                self._blend_config,
                self.layout,
                self._store,
                rank=self._rank,
                tp_size=self._tp_size,
                stats=self._stats,
                load_timeout_s=self._load_timeout_s,
                model=built_model,
                staging=self._staging,
            )
        # Host memory: each block lands in the cache as its read completes. A GPU's cache is filled
        # per layer from staging, where the copy to the device overlaps the previous layer's compute.
        self._lands = self.layout.device.type == "cpu"
        allowed = all(share.layout.in_place for share in self._shares) and self._load_timeout_s is None
        self._in_place = allowed if self._in_place_option is None else self._in_place_option and allowed
        logger.info(
            "UCM: %d layers, %d blocks, %d share(s) of %d bytes per block in the store (%s), loads %s",
            len(self.layout.slots),
            num_blocks,
            len(self._shares),
            self._shares[0].layout.block_bytes,
            ", ".join(f"{s.index} of {s.of}" for s in self._shares),
            "in place" if self._in_place else "staged",
        )

    def _staging_rows(self) -> int:
        assert self.layout is not None
        return min(self.layout.num_blocks, max(1, self._staging_bytes // self.layout.block_bytes))

    @staticmethod
    def _keys(transfer: BlockTransfer, share: Share) -> list[bytes]:
        return rank_keys(transfer.store_ids, share.index, share.of)

    # -- loading ---------------------------------------------------------------------------------
    def start_load(self, meta: UCMConnectorMetadata) -> None:
        assert self.layout is not None, "register_kv_caches must run before the first step"
        self._loads = []
        blocks = [b for transfer in meta.loads for b in transfer.block_ids]
        blended = [b for blend in meta.blends for b in blend.block_ids[blend.first_block :]]
        invalidate_summaries(blocks + blended)
        self._abandoned = [t for t in self._abandoned if not t.done()]
        if self._abandoned and (blocks or blended):
            self._load_errors.update(blocks + blended)  # vLLM recomputes them
            skipped = len(blocks) * len(self._shares)  # counted per share, as loads are
            self._stats.add("load_failed_blocks", skipped)
            self._stats.add("store_skipped_blocks", skipped)
            return
        for transfer in meta.loads:
            # One staging buffer per transfer: share j reads into its columns of each block's row.
            buffer = None if self._in_place else self._staging.take(len(transfer.block_ids))
            for j, share in enumerate(self._shares):
                self._loads.append(self._start_load(transfer, share, buffer, j))
        if self._load_mode == "step" or meta.blends:  # a blend reads the exact prefix: loaded first
            for layer in range(len(self.layout.slots)):
                self._scatter_layer(layer)
        for blend in meta.blends:
            self._run_blend(blend)

    def offload(self, meta: UCMConnectorMetadata) -> None:
        """Sparse off-load, before the step's forward: the blocks freed this step still hold their
        bytes, and the step's sparse plan names the arena where they go."""
        runtimes = offloading_runtimes()
        for runtime in runtimes:
            runtime.release(meta.released)
            for move in meta.offloads:
                runtime.offload(move.req_id, move.first, move.block_ids, move.arena, move.slots, self._kv_caches)
            runtime.place_offloaded(meta.offloaded)
        # The copies the previous step's layers made (this step's are counted at the next).
        fetched = sum(runtime.fetched for runtime in runtimes)
        self._stats.add("sparse_offload_fetched_block_heads", fetched - self._fetched_seen)
        self._fetched_seen = fetched

    def _start_load(self, transfer: BlockTransfer, share: Share, buffer: torch.Tensor | None, j: int) -> _Load:
        started = time.perf_counter()
        keys, layout, n = self._keys(transfer, share), share.layout, len(transfer.block_ids)
        if buffer is None:
            blobs = [layout.block_segments(b) for b in transfer.block_ids]
            return _Load(transfer, share, None, self._store.load(keys, blobs), started)
        staging = share_columns(buffer, n, layout, j)
        if self._lands:
            landing = Landing(layout, transfer.block_ids)
            task = self._store.load(keys, list(staging.numpy()), landing)
            return _Load(transfer, share, None, task, started, buffer=buffer, landing=landing)
        return _Load(transfer, share, staging, self._store.load(keys, list(staging.numpy())), started, buffer=buffer)

    def _run_blend(self, blend: BlendTransfer) -> None:
        """Blend one region; if it cannot be (its exact prefix failed to load, no model, an error),
        its blocks fail as a load does, and vLLM computes them."""
        first = blend.first_block
        done = False
        if self._blender is None:
            logger.error(
                "UCM: request %s: a blend was planned but this worker has no blend configuration", blend.req_id
            )
        elif not self._load_errors.intersection(blend.block_ids[:first]):
            try:
                done = self._blender.run(blend)
            except Exception:
                logger.exception("UCM: request %s: blending failed; computing it instead", blend.req_id)
        if not done:
            self._load_errors.update(blend.block_ids[first:])

    def wait_layer(self, layer_name: str) -> None:
        if self._loads and self._load_mode == "layer":
            assert self.layout is not None
            layer = self.layout.layer_index(layer_name)
            if layer not in self._scattered:  # a step with a blend scattered every layer up front
                self._scatter_layer(layer)

    def _scatter_layer(self, layer: int) -> None:
        assert self.layout is not None
        self._scattered.add(layer)
        for load in self._loads:
            if load.ok is None:
                self._finish_load(load)
            good = [i for i, ok in enumerate(load.ok or []) if ok]
            if not good or load.staging is None:  # in place or landed: the bytes are already there
                continue
            layout = load.share.layout
            if len(good) == len(load.transfer.block_ids):
                layout.scatter_layer(layer, load.transfer.block_ids, load.staging)
            else:
                rows = load.staging[torch.tensor(good)]
                layout.scatter_layer(layer, [load.transfer.block_ids[i] for i in good], rows)

    def _finish_load(self, load: _Load) -> None:
        try:
            remaining = None
            if self._load_timeout_s is not None:
                remaining = max(0.0, load.started + self._load_timeout_s - time.perf_counter())
            load.ok = load.task.wait(remaining)
        except TimeoutError:
            logger.warning(
                "UCM: request %s: load of %d blocks not done after %.1f s; recomputing them",
                load.transfer.req_id,
                len(load.transfer.block_ids),
                self._load_timeout_s,
            )
            self._stats.add("load_timeouts", 1)
            load.ok = [False] * len(load.transfer.block_ids)
            self._stop_load(load)
        n_ok = sum(load.ok)
        failed = [b for b, ok in zip(load.transfer.block_ids, load.ok, strict=True) if not ok]
        if failed:
            # vLLM recomputes these (and, by chaining, what follows them in the request).
            self._load_errors.update(failed)
            logger.warning(
                "UCM: request %s: %d of %d blocks failed to load; recomputing them",
                load.transfer.req_id,
                len(failed),
                len(load.ok),
            )
        self._stats.add("loaded_blocks", n_ok)
        self._stats.add("loaded_bytes", n_ok * load.share.layout.block_bytes)
        self._stats.add("load_failed_blocks", len(failed))
        self._stats.observe("load_seconds", time.perf_counter() - load.started)

    def _stop_load(self, load: _Load) -> None:
        """A load whose blocks vLLM recomputes: a landing is closed; a read in place (no deadline)
        writes the cache itself and is waited for; a read still running is abandoned."""
        if load.landing is not None:
            load.landing.close()
        elif load.staging is None:
            load.task.wait()
        if not load.task.done():
            self._abandoned.append(load.task)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saving ----------------------------------------------------------------------------------
    def save_layer(self, layer_name: str, meta: UCMConnectorMetadata) -> None:
        if not meta.saves or self._save_mode != "layer":
            return
        assert self.layout is not None
        if self._saved_layers == 0:
            self._saves = self._new_saves(meta)
        layer = self.layout.layer_index(layer_name)
        for save in self._saves:
            for share, view in zip(self._shares, save.views, strict=True):
                share.layout.gather_layer(layer, save.transfer.block_ids, view)
        self._saved_layers += 1

    def finish_step(self, meta: UCMConnectorMetadata) -> None:
        """End of the step: complete the copies and hand the blocks to the store."""
        assert self.layout is not None
        if meta.saves and (self._save_mode == "step" or self._saved_layers < len(self.layout.slots)):
            # save_mode=step, or layers that never reported (all of them are copied now).
            if not self._saves:
                self._saves = self._new_saves(meta)
            for save in self._saves:
                for share, view in zip(self._shares, save.views, strict=True):
                    share.layout.gather(save.transfer.block_ids, view)
        if self._loads and len(self._scattered) < len(self.layout.slots):
            # Loaded KV never reached some layers: fail those blocks so vLLM recomputes them.
            missing = sorted(set(range(len(self.layout.slots))) - self._scattered)
            logger.error("UCM: vLLM did not call wait_for_layer_load for layers %s; set load_mode: step", missing)
            for load in self._loads:
                self._load_errors.update(load.transfer.block_ids)
                if load.ok is None:  # never waited for: none of it may reach the cache from now on
                    self._stop_load(load)
        pd_tasks = []
        for save in self._untainted(meta):
            tasks = [self._dump(save.transfer, s, view) for s, view in zip(self._shares, save.views, strict=True)]
            self._staging.give_when_done(save.buffer, tasks)
            if save.transfer.wait:
                pd_tasks += tasks
        self._wait_for_pd_saves(pd_tasks)
        reads: dict[int, tuple[torch.Tensor, list[Task]]] = {}  # a transfer's shares share one buffer
        for load in self._loads:
            if load.buffer is not None:
                reads.setdefault(id(load.buffer), (load.buffer, []))[1].append(load.task)
        for buffer, tasks in reads.values():
            self._staging.give_when_done(buffer, tasks)  # an abandoned read keeps it until it ends
        self._saves = []
        self._saved_layers = 0
        self._loads = []
        self._scattered = set()

    def _untainted(self, meta: UCMConnectorMetadata) -> list[_Save]:
        """This step's saves, or none if a load or blend failed in it. A request whose load failed
        computed its new blocks over KV that is not its prompt's (stale or partly read memory), and
        so did any request attending over the same blocks through vLLM's prefix cache: vLLM discards
        their output and computes again, but stored, those blocks would be served under their
        prompts' ids as wrong KV (a stored block is never rewritten). Failures are rare (a block lost
        between lookup and load), so the whole step's saves go rather than guessing who shared."""
        transfers: list[BlockTransfer | BlendTransfer] = [*meta.loads, *meta.blends]
        if not self._saves or not transfers:  # the same on every rank: the scheduler's metadata
            return self._saves
        failed = any(not self._load_errors.isdisjoint(t.block_ids) for t in transfers)
        # Another TP rank's missing KV reaches this rank's later layers through the all-reduces, an
        # earlier stage's through the hidden states this stage computes from.
        if self._stages is not None:
            failed = self._stages.relay(failed, self._any_rank)
        elif self._any_rank is not None:
            failed = self._any_rank(failed)
        if not failed:
            return self._saves
        dropped = sum(len(save.transfer.block_ids) * len(save.views) for save in self._saves)
        for save in self._saves:
            self._staging.give(save.buffer)
        logger.warning("UCM: a load failed in this step; its %d new blocks are not saved (computed over it)", dropped)
        # Counted as failed saves: a PD consumer is then promised no blocks that will not come.
        self._stats.add("save_failed_blocks", dropped)
        return []

    def _new_saves(self, meta: UCMConnectorMetadata) -> list[_Save]:
        saves = []
        for t in meta.saves:
            n = len(t.block_ids)
            buffer = self._staging.take(n)
            views = [share_columns(buffer, n, s.layout, j) for j, s in enumerate(self._shares)]
            saves.append(_Save(t, buffer, views))
        return saves

    def _wait_for_pd_saves(self, tasks: list[Task]) -> None:
        """A PD prefill's blocks are in the store before its answer leaves (up to pd_save_wait_s)."""
        if not tasks or self._pd_save_wait_s <= 0:
            return
        started = time.perf_counter()
        deadline = started + self._pd_save_wait_s
        try:
            for task in tasks:
                task.wait(max(0.0, deadline - time.perf_counter()))
        except TimeoutError:
            self._stats.add("pd_save_wait_timeouts", 1)
            logger.warning("UCM: PD saves not in the store after %.1f s; answering anyway", self._pd_save_wait_s)
        self._stats.observe("pd_save_wait_seconds", time.perf_counter() - started)

    def _dump(self, transfer: BlockTransfer, share: Share, staging: torch.Tensor) -> Task:
        started = time.perf_counter()
        task = self._store.dump(self._keys(transfer, share), list(staging.numpy()))
        block_bytes = staging.shape[1]

        def done(t: Task) -> None:
            ok = t.wait(0)
            n_ok = sum(ok)
            self._stats.add("saved_blocks", n_ok)
            self._stats.add("saved_bytes", n_ok * block_bytes)
            self._stats.add("save_failed_blocks", len(ok) - n_ok)
            self._stats.observe("save_seconds", time.perf_counter() - started)
            with self._inflight_lock:
                self._inflight.discard(t)

        with self._inflight_lock:
            self._inflight.add(task)
        task.add_done_callback(done)
        return task

    def close(self) -> None:
        """Dumps still being written finish first, for at most ``workers.CLOSE_WAIT_S`` in all (a hung
        store must not hold the engine's exit). vLLM calls this only on some exits (its process
        manager kills workers on SIGTERM): a PD prefill's own saves are waited for in the step."""
        with self._inflight_lock:
            pending = list(self._inflight)
        deadline = time.monotonic() + workers.CLOSE_WAIT_S
        try:
            for task in pending:
                task.wait(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            unsaved = sum(len(t) for t in pending if not t.done())
            logger.warning(
                "closing with %d blocks not saved after %.1f s: the store does not answer",
                unsaved,
                workers.CLOSE_WAIT_S,
            )
        self._store.close()
