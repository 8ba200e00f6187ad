"""UCMConnector: vLLM's KV connector API on top of UCM's hashing and stores.

Load it with::

    --kv-transfer-config '{"kv_connector": "UCMConnector",
                           "kv_connector_module_path": "ucm.integration.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": {"spec": "posix",
                                                                    "posix": {"roots": ["/kv"]}}}}'

``kv_role``: ``kv_producer`` only saves, ``kv_consumer`` only loads, ``kv_both`` does both.
The scheduler half (:mod:`.scheduler`) decides, the worker half (:mod:`.worker`) moves bytes;
this class only adapts vLLM's calls to them.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ucm.config import ConfigError
from ucm.environment import apply_environment
from ucm.hashing import HashContext
from ucm.integration.vllm.config import (
    WHERE,
    ConnectorConfig,
    check_parallel_layout,
    check_vllm_version,
    parse_connector_config,
    prefixed_errors,
    scheduler_store_config,
    shares_per_rank,
    sparse_config,
)
from ucm.integration.vllm.events import StoreEvents
from ucm.integration.vllm.health import StoreHealth
from ucm.integration.vllm.identity import Adapters, engine_identity, weights_fingerprint
from ucm.integration.vllm.metadata import UCMConnectorMetadata
from ucm.integration.vllm.offload import OffloadPlanner
from ucm.integration.vllm.scheduler import BlendSettings, SchedulerSide
from ucm.integration.vllm.stats import StatsRecorder, UCMConnectorStats, UCMPromMetrics
from ucm.integration.vllm.worker import StageRelay, WorkerSide, or_across
from ucm.store import create_store
from ucm.store.breaker import BreakerStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class UCMConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_vllm_version(vllm.__version__)
        apply_environment(os.environ)
        transfer = self._kv_transfer_config
        self._config = config = parse_connector_config(transfer.kv_connector_extra_config)
        kv_role = transfer.kv_role or "kv_both"
        can_load = kv_role in ("kv_consumer", "kv_both")
        can_save = kv_role in ("kv_producer", "kv_both")
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        cache = vllm_config.cache_config
        kv_dtype = str(model.dtype).removeprefix("torch.") if cache.cache_dtype == "auto" else str(cache.cache_dtype)
        check_parallel_layout(parallel)
        _check_deferred_saves(vllm_config)
        if config.blend is not None:
            _check_blend(kv_role, parallel)
        sparse = sparse_config(transfer.kv_connector_extra_config, WHERE)
        offload = sparse is not None and sparse.offload_blocks > 0
        if offload:
            _check_offload(vllm_config)
        # Each worker (TP rank x pipeline stage) keeps its own share of a block under its own key; with
        # store_tp, the store's split (a multiple of this engine's) decides the shares and the ids.
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        kv_heads = model.get_total_num_kv_heads()
        shares = shares_per_rank(config.store_tp, tp, pp, kv_heads, config.blend is not None, model.use_mla)
        context = HashContext(
            model=config.model_id or str(model.model),
            dtype=kv_dtype,
            block_size=cache.block_size,
            tp_size=tp * shares,
            salt=config.salt,
            algorithm=config.hash_algorithm,
            weights=weights_fingerprint(str(model.model), model.revision),
            pp_size=parallel.pipeline_parallel_size,
            engine=engine_identity(model, cache),
        )
        self._stats = StatsRecorder()
        self._scheduler: SchedulerSide | None = None
        self._offload: OffloadPlanner | None = None
        self._worker: WorkerSide | None = None
        is_scheduler = role == KVConnectorRole.SCHEDULER
        with prefixed_errors():
            self._store = store = create_store(scheduler_store_config(config.store) if is_scheduler else config.store)
        if is_scheduler:
            # vLLM reads this right after building the scheduler's connector.
            transfer.kv_load_failure_policy = config.load_failure
            self._scheduler = SchedulerSide(
                context,
                store,
                can_load=can_load,
                can_save=can_save,
                pd_wait_timeout_s=config.pd_wait_timeout_s,
                stats=self._stats,
                tp_size=tp * shares * pp,
                lookup_timeout_s=config.lookup_timeout_s,
                decode_save_blocks=config.decode_save_blocks,
                health=StoreHealth(config.store_unhealthy_after_s),
                events=StoreEvents(cache.block_size) if _publishes_events(vllm_config) else None,
                blend=None if config.blend is None else BlendSettings(config.blend, _separator(vllm_config, config)),
                adapters=Adapters(vllm_config.lora_config),
            )
            if offload:
                assert sparse is not None
                self._offload = OffloadPlanner(sparse, cache.block_size, self._stats)
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank, get_tp_group

            rank = get_pp_group().rank_in_group * parallel.tensor_parallel_size + get_tensor_model_parallel_rank()
            if config.store_breaker is not None:
                health = StoreHealth(config.store_unhealthy_after_s, worker=rank)
                self._store = store = BreakerStore(
                    store, config.store_breaker, on_degraded=health.stuck, on_recovered=health.answered
                )
            self._worker = WorkerSide(
                store,
                rank=rank,
                tp_size=tp * pp,
                shares_per_rank=shares,
                kv_heads=model.get_num_kv_heads(parallel),
                load_mode=config.load_mode,
                save_mode=config.save_mode,
                stats=self._stats,
                load_timeout_s=config.load_timeout_s,
                staging_bytes=int(config.load_staging),
                pd_save_wait_s=config.pd_save_wait_s,
                blend=config.blend,
                any_rank=functools.partial(or_across, group=get_tp_group().cpu_group) if tp > 1 else None,
                stages=StageRelay.of(get_pp_group()) if pp > 1 else None,
                huge_pages=config.huge_pages,
            )
        self._num_blocks = kv_cache_config.num_blocks
        logger.info("UCMConnector %s: role=%s store=%s", role.name.lower(), kv_role, config.store["spec"])

    # -- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:  # vLLM may start the step's loads after its forward, not this
            self._worker.offload(self._meta())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.finish_step(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def _meta(self) -> UCMConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UCMConnectorMetadata)
        return meta

    # -- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._offload is not None:
            self._offload.bind(kv_cache_manager)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._scheduler.build_meta(scheduler_output)
        if self._offload is not None:
            self._offload.plan(scheduler_output, self._scheduler.requests(), meta)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        stats = connector_output.kv_connector_stats
        if stats is not None:
            self._scheduler.worker_stats(stats.data)
        if connector_output.invalid_block_ids:
            self._scheduler.loads_failed(connector_output.invalid_block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        assert self._scheduler is not None
        return self._scheduler.take_events()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        if self._offload is not None:
            self._offload.release(request.request_id)
        # Saves copy out of the paged cache during the step, so vLLM may free the blocks at once.
        return False, self._scheduler.finished(request)

    # -- both sides ------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            self._worker.collect_store_counters()
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return UCMConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # type: ignore[no-untyped-def]
        return UCMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        else:
            self._store.close()


def _check_deferred_saves(vllm_config: VllmConfig) -> None:
    """With speculative decoding, vLLM's V1 model runner ends the connector's step (wait_for_save)
    after the draft model, which only the last pipeline stage runs: the earlier stages would never
    save, and the last would wait for their word on failed loads (``StageRelay``) for ever."""
    if (
        vllm_config.parallel_config.pipeline_parallel_size > 1
        and vllm_config.speculative_config is not None
        and not vllm_config.use_v2_model_runner
    ):
        raise ConfigError(
            "--speculative-config with --pipeline-parallel-size above 1: vLLM's V1 model runner (this "
            "engine's) ends a step's KV transfers on the last pipeline stage only; leave one of them out"
        )


def _check_offload(vllm_config: VllmConfig) -> None:
    """Off-load frees blocks of a request the worker still names in its block table, and moves them
    before the forward of the step that freed them: nothing may run a step ahead. Tensor-parallel
    ranks each hold their KV heads of every block and move them with the same metadata; pipeline
    stages run several steps at once, so a stage could move a block a later step already reuses."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            f"{WHERE}.sparse.offload_blocks: needs one pipeline stage "
            "(pipeline parallel size 1; tensor parallel is fine)"
        )
    if vllm_config.scheduler_config.async_scheduling:
        raise ConfigError(f"{WHERE}.sparse.offload_blocks: needs synchronous scheduling (leave out --async-scheduling)")
    if vllm_config.speculative_config is not None:
        raise ConfigError(f"{WHERE}.sparse.offload_blocks: decodes one token per step; leave out --speculative-config")


def _check_blend(kv_role: str, parallel: Any) -> None:
    if kv_role == "kv_producer":
        raise ConfigError(f"{WHERE}.blend: a kv_producer never loads; use kv_both or kv_consumer")
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        raise ConfigError(f"{WHERE}.blend: tensor and pipeline parallel engines cannot blend yet; run with both at 1")


def _separator(vllm_config: VllmConfig, config: ConnectorConfig) -> tuple[int, ...]:
    """The blend separator's tokens: what the model's tokenizer makes of the text alone."""
    from vllm.tokenizers import cached_tokenizer_from_config

    assert config.blend is not None
    tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
    ids = tuple(tokenizer.encode(config.blend.separator, add_special_tokens=False))
    if not ids:
        raise ConfigError(f"{WHERE}.blend.separator: {config.blend.separator!r} makes no tokens")
    return ids


def _publishes_events(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config``): only then are the store's built."""
    events = vllm_config.kv_events_config
    return events is not None and bool(events.enable_kv_cache_events) and events.publisher != "null"
