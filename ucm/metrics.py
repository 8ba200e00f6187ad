"""Prometheus metrics of the library (``ucm_`` prefix, base units).

Defined once here so every process exposes the same names; the connector and the CLI serve
them through ``prometheus_client``'s default registry.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Store I/O spans memory copies (microseconds) to network filesystems (seconds).
_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

STORE_BLOCKS = Counter(
    "ucm_store_blocks_total",
    "Blocks loaded or dumped, by outcome",
    ["backend", "op", "result"],
)
STORE_BYTES = Counter(
    "ucm_store_bytes_total",
    "Payload bytes successfully loaded or dumped",
    ["backend", "op"],
)
STORE_LOOKUP_BLOCKS = Counter(
    "ucm_store_lookup_blocks_total",
    "Block ids looked up",
    ["backend"],
)
STORE_LOOKUP_HITS = Counter(
    "ucm_store_lookup_hits_total",
    "Block ids found by lookups",
    ["backend"],
)
STORE_CORRUPT_BLOCKS = Counter(
    "ucm_store_corrupt_blocks_total",
    "Stored blocks that failed their integrity check and were treated as misses",
    ["backend"],
)
STORE_EVICTED_BLOCKS = Counter(
    "ucm_store_evicted_blocks_total",
    "Blocks removed to keep the store under its capacity",
    ["backend"],
)
STORE_PROMOTED_BLOCKS = Counter(
    "ucm_store_promoted_blocks_total",
    "Blocks a load found only in a slower tier, copied into this (faster) one",
    ["backend"],
)
STORE_EVICTED_BYTES = Counter(
    "ucm_store_evicted_bytes_total",
    "Bytes removed to keep the store under its capacity",
    ["backend"],
)
# Set by each capacity check (a scan of the store); "livemax": the engine's /metrics shows the
# latest-scanning live process's figure, not a sum over processes that share one store.
STORE_USED_BYTES = Gauge(
    "ucm_store_used_bytes",
    "Bytes of blocks in the store at the last capacity check (stores with a capacity)",
    ["backend"],
    multiprocess_mode="livemax",
)
STORE_CAPACITY_BYTES = Gauge(
    "ucm_store_capacity_bytes",
    "The store's capacity: above it, least-recently-used blocks are evicted",
    ["backend"],
    multiprocess_mode="livemax",
)
STORE_DEGRADED = Gauge(
    "ucm_store_degraded",
    "1 while the store is skipped: its operations timed out in a row and no probe was answered in time since",
    ["backend"],
    multiprocess_mode="livemax",
)
STORE_SKIPPED_BLOCKS = Counter(
    "ucm_store_skipped_blocks_total",
    "Blocks not loaded or saved (recomputed, or not stored) because the store was degraded",
    ["backend", "op"],
)
STORE_OP_SECONDS = Histogram(
    "ucm_store_operation_seconds",
    "Latency of one batched store operation, from submission to completion",
    ["backend", "op"],
    buckets=_LATENCY_BUCKETS,
)


SPARSE_REQUESTS = Counter(
    "ucm_sparse_requests_total",
    "Requests that started decoding with sparse attention",
    ["algorithm"],
)
SPARSE_BLOCKS_ATTENDED = Counter(
    "ucm_sparse_blocks_attended_total",
    "KV blocks sparse decoding attended, summed over requests, layers and steps",
    ["algorithm"],
)
SPARSE_BLOCKS_AVAILABLE = Counter(
    "ucm_sparse_blocks_available_total",
    "KV blocks those requests held, summed the same way (attended / available = the fraction read)",
    ["algorithm"],
)
SPARSE_DECODE_TOKENS = Counter(
    "ucm_sparse_decode_tokens_total",
    "Decode tokens of an engine with sparse attention, by path: sparse; dense_short, the request shorter than "
    "min_tokens (below that length selection does not pay for itself); dense_first, a prompt's last token "
    "computed alone (a PD decode's first step), which attends densely as at the end of a computed prompt",
    ["algorithm", "path"],
)
SPARSE_SELECTION_SECONDS = Histogram(
    "ucm_sparse_selection_seconds",
    "Time one engine step spent choosing blocks (all layers and sparse requests)",
    ["algorithm"],
    buckets=_LATENCY_BUCKETS,
)


def counter_total(counter: Counter) -> float:
    """Sum of a counter over all its label values (in this process)."""
    return sum(
        sample.value for metric in counter.collect() for sample in metric.samples if sample.name.endswith("_total")
    )
