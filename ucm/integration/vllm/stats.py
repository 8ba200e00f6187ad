"""Connector figures, carried from vLLM's worker and scheduler processes to its ``/metrics``.

vLLM runs the worker half of the connector in other processes, so figures travel as
:class:`UCMConnectorStats` (a plain dict, serializable) through vLLM's connector-stats hooks, are
summed across workers, and land in Prometheus through :class:`UCMPromMetrics`.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS: dict[str, str] = {
    "loaded_blocks": "Blocks loaded from the store into the paged KV cache",
    "loaded_bytes": "Bytes loaded from the store",
    "load_failed_blocks": "Blocks whose load failed; vLLM recomputes them",
    "saved_blocks": "Blocks written to the store",
    "saved_bytes": "Bytes written to the store",
    "save_failed_blocks": "Blocks whose save failed (a later request recomputes them)",
    "external_hit_tokens": "Prompt tokens served from the store instead of computed",
    "pd_wait_timeouts": "Consumer requests that stopped waiting for a producer's blocks and recomputed",
    "pd_save_wait_timeouts": "PD prefill steps that answered before their saves were in the store",
    "load_timeouts": "Loads abandoned at their deadline (their blocks recomputed)",
    "lookup_timeouts": "Store lookups answered as misses because the store did not answer in time",
    "lookup_deadline_skips": "Requests not looked up (misses, recomputed): their scheduler step had spent "
    "its lookup_timeout_s on other lookups",
    "store_corrupt_blocks": "Stored blocks that failed their integrity check in this engine's workers",
    "store_evicted_blocks": "Blocks evicted by this engine's workers to keep stores under capacity",
    "store_skipped_blocks": "Blocks this engine's workers did not load or save because the store was degraded",
    "sparse_offloaded_blocks": "Blocks of decoding requests moved from the paged KV cache to the host arena "
    "(sparse.offload_blocks)",
    "sparse_offload_blocks_saved": "Paged KV cache blocks sparse off-loads gave back: blocks freed (not shared "
    "with another request's prefix) minus the slots their requests attend them through",
    "sparse_offload_fetched_block_heads": "Off-loaded blocks' KV heads copied from the host arena into their "
    "requests' slots, summed over layers and ranks (one a slot still holds from an earlier step is not copied "
    "again): the memory traffic off-load adds to sparse decoding",
    "blend_chunks_hit": "Prompt chunks whose KV Blend found in the store (at least their first block)",
    "blend_chunks_missed": "Prompt chunks of a block or more that Blend did not find in the store",
    "blend_reused_tokens": "Tokens whose cached KV Blend kept past its check layer",
    "blend_recomputed_tokens": "Tokens Blend computed through every layer (selected, or without a cached KV)",
    "bypassed_multimodal_requests": "Requests with multimodal inputs, kept out of the store: their placeholder "
    "tokens do not name their KV",
    "bypassed_prompt_embeds_requests": "Requests given as prompt embeddings, kept out of the store: no tokens name "
    "their KV",
    "bypassed_adapter_requests": "LoRA requests kept out of the store: their adapter could not be fingerprinted "
    "(not a directory), or changed since the engine loaded it",
    "blend_chunk_lists_refused": "Requests whose kv_transfer_params.ucm_chunks was malformed or longer than "
    "blend.max_chunks: prefilled without Blend",
}
HISTOGRAMS: dict[str, str] = {
    "load_seconds": "Time to load one request's blocks in one step",
    "save_seconds": "Time to write one request's blocks in one step",
    "pd_wait_seconds": "Time a consumer request waited for a producer's blocks to become visible",
    "pd_save_wait_seconds": "Time a PD prefill step waited for its saves to be in the store",
    "blend_seconds": "Time to blend one request's region (loading its chunks included)",
}
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class UCMConnectorStats(KVConnectorStats):
    """Counters (summed) and latency samples (concatenated) since the last report."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> UCMConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            if isinstance(value, list):
                merged[key] = [*merged.get(key, []), *value]
            else:
                merged[key] = merged.get(key, 0) + value
        return UCMConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if not isinstance(v, list)}
        for key, samples in self.data.items():
            if isinstance(samples, list) and samples:
                out[f"{key}_avg"] = round(sum(samples) / len(samples), 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsRecorder:
    """Thread-safe accumulation (store callbacks run on I/O threads); ``take`` empties it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}

    def add(self, key: str, value: int) -> None:
        if value:
            with self._lock:
                self._data[key] = self._data.get(key, 0) + value

    def observe(self, key: str, seconds: float) -> None:
        with self._lock:
            self._data.setdefault(key, []).append(seconds)

    def take(self) -> UCMConnectorStats | None:
        with self._lock:
            data, self._data = self._data, {}
        return UCMConnectorStats(data=data) if data else None


class UCMPromMetrics(KVConnectorPromMetrics):
    """``ucm_connector_*`` metrics on ``vllm serve``'s /metrics, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:  # type: ignore[no-untyped-def]
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"ucm_connector_{key}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, doc in COUNTERS.items()
        }
        self._histograms = {
            key: create_metric_per_engine(
                self._histogram_cls(
                    name=f"ucm_connector_{key}", documentation=doc, labelnames=labelnames, buckets=_BUCKETS
                ),
                per_engine_labelvalues,
            )
            for key, doc in HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._counters and value:
                self._counters[key][engine_idx].inc(value)
            elif key in self._histograms:
                for sample in value:
                    self._histograms[key][engine_idx].observe(sample)
