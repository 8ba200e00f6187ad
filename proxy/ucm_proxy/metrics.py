"""``ucm_proxy_*`` Prometheus metrics."""

from __future__ import annotations

import functools
from typing import TypeVar

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter(
    "ucm_proxy_requests_total",
    "Client requests by route, status and path (pd: prefill then decode; direct: decode alone, the prompt "
    "short or its prefix stored; fallback: decode alone, no prefill available; decode_only: a mixed pool; "
    "none: refused before routing)",
    ["route", "status", "path"],
)
LATENCY = Histogram("ucm_proxy_request_seconds", "Client request duration", ["route"], buckets=_BUCKETS)
TTFB = Histogram(
    "ucm_proxy_time_to_first_byte_seconds", "From request to the first response byte", ["route"], buckets=_BUCKETS
)
IN_FLIGHT = Gauge("ucm_proxy_backend_in_flight", "Requests in flight per backend", ["backend", "role"])
ENGINE_LOAD = Gauge(
    "ucm_proxy_backend_load",
    "Requests on the backend as routing weighs them: its engine's running + waiting at the last reading, plus "
    "what this proxy sent since",
    ["backend", "role"],
)
BACKEND_HEALTHY = Gauge("ucm_proxy_backend_healthy", "1 when the backend passes its health check", ["backend", "role"])
BACKEND_STORE_DEGRADED = Gauge(
    "ucm_proxy_backend_store_degraded",
    "1 when the backend's last health check said its KV store does not answer (X-UCM-Store: degraded): it "
    "serves on, but is not used as a PD prefill",
    ["backend", "role"],
)
EJECTIONS = Counter(
    "ucm_proxy_backend_ejections_total", "Backends ejected after consecutive failures", ["backend", "role"]
)
REJECTED = Counter(
    "ucm_proxy_rejected_requests_total",
    "Requests refused by a limit that protects the proxy, by reason: header_bytes, header_count (431: the head "
    "over max_header_bytes or max_header_count), header_timeout, body_timeout (408: past timeouts.header_s or "
    "body_s), in_flight, in_flight_bytes (429: the proxy at max_in_flight or max_in_flight_bytes), client_bytes "
    "(429: the client at its share, max_client_bytes), scrape_token (401: /metrics or /pd-path without the "
    "metrics_token_file's token)",
    ["reason"],
)
WAITING = Gauge("ucm_proxy_waiting_requests", "Requests waiting for a backend of a pool with none available", ["role"])
# A counter, unlike WAITING: a request waits seconds (timeouts.queue_s), too briefly for a scrape to see,
# and a pool scaled to zero has no series of its own to wake it by (ucm.deploy.autoscaling).
UNSERVED = Counter(
    "ucm_proxy_unserved_requests",
    "Requests that found no backend of the pool available (then waiting up to timeouts.queue_s, or none for "
    "prefill with fallback_to_decode)",
    ["role"],
)
RETRIES = Counter("ucm_proxy_retries_total", "Upstream attempts repeated on another backend", ["role"])
PD_PATH_HEALTHY = Gauge(
    "ucm_proxy_pd_path_healthy", "1 when the last check through prefill, store and decode passed (decode loaded KV)"
)
PD_PATH_CHECKS = Counter(
    "ucm_proxy_pd_path_checks_total", "PD path checks by result (a reason naming the hop)", ["result"]
)
PD_PAIRS = Counter(
    "ucm_proxy_pd_pairs_total",
    "PD requests by whether decode's pairing identity matched the prefill's (unknown: an engine named none)",
    ["matched"],
)
PD_DECODE_KV = Counter(
    "ucm_proxy_pd_decode_kv_total",
    "PD answers (not streamed) where decode loaded the prompt's KV from the store, or computed it all",
    ["outcome"],
)


@functools.cache
def child(metric: M, *labels: str) -> M:
    """``metric.labels(*labels)``, looked up once: the per-request series (route, status, decision)
    are few and never removed, and ``labels`` validates and locks on every call."""
    return metric.labels(*labels)


def forget_backend(url: str, role: str) -> None:
    """Drop a departed backend's series (a pod that is gone must not stay healthy=1 forever)."""
    for metric in (IN_FLIGHT, ENGINE_LOAD, BACKEND_HEALTHY, BACKEND_STORE_DEGRADED, EJECTIONS):
        try:
            metric.remove(url, role)
        except KeyError:
            pass  # it never had that series
    for metric in (KV_INDEX_BLOCKS, KV_EVENT_STREAM_UP):
        try:
            metric.remove(url)
        except KeyError:
            pass


DISAGGREGATION = Counter(
    "ucm_proxy_disaggregation_decisions_total",
    "PD requests by decision: cold (prefilled remotely), short, stored or balance (straight to decode)",
    ["decision"],
)
KV_INDEX_BLOCKS = Gauge(
    "ucm_proxy_kv_index_blocks", "Blocks the KV index holds per engine (from its KV events)", ["backend"]
)
KV_EVENT_STREAM_UP = Gauge(
    "ucm_proxy_kv_event_stream_up",
    "1 while the proxy's subscription to an engine's KV events is connected (its replay, when it has one, asked "
    "for and applied as far as it answered)",
    ["backend"],
)
KV_EVENTS = Counter(
    "ucm_proxy_kv_events_total",
    "KV events read, by kind: stored, removed, cleared; other_tier (not the engine's own cache, or not its first "
    "KV cache group), orphan (a block whose parent the index never saw), malformed (a batch or event that is "
    "not vLLM's KVEventBatch: dropped, and that engine's entries cleared)",
    ["kind"],
)
KV_RESYNCS = Counter(
    "ucm_proxy_kv_event_resyncs_total",
    "Times an engine's index entries were cleared and rebuilt (from its replay endpoint when it has one), by "
    "reason: connect (the subscription came up: rebuilt from the replay), start (first batch after connecting "
    "to an engine without a replay endpoint), gap (a lost batch), restart (its sequence started over), "
    "malformed",
    ["reason"],
)
KV_EVENT_LAG = Histogram(
    "ucm_proxy_kv_event_lag_seconds",
    "From an engine's event batch (its timestamp) to the index applying it",
    buckets=_BUCKETS,
)
KV_ROUTING = Counter(
    "ucm_proxy_kv_routing_total",
    "kv_aware decisions by reason: hit (an engine's cached prefix chose it), no_hits (no engine holds the prompt's "
    "first block: least outstanding), no_index (no engine has announced blocks yet), no_tokens (the prompt could "
    "not be tokenized: least outstanding)",
    ["reason"],
)
KV_PREDICTED_HIT_TOKENS = Counter(
    "ucm_proxy_kv_predicted_hit_tokens_total",
    "Prompt tokens the KV index said the chosen engine would not compute: its own cache's, plus "
    "kv_aware_store_weight for each further one the store holds (compare with vLLM's prefix cache hits)",
)
