"""Backends, their health, and how one is chosen for a request.

Health is active (a periodic GET of each backend's health path) and passive (a request that fails
to connect or gets a 5xx counts against its backend): ``eject_after`` consecutive failures eject
a backend for a backoff that doubles with each ejection. An ejection lasts its whole backoff — a
backend whose ``/health`` answers while its requests fail is not let back early — and the backoff
starts over only once the backend serves a request again. A failing health check takes a backend
out until one passes.

Engines started by ``ucm serve`` name their *pairing identity* in ``/health`` (``X-UCM-KV-Identity``:
model, dtypes, block size, layout, store and hashing; ``ucm.integration.vllm.identity``): a prefill
is paired only with a decode of the same identity, so during a rollout that changes any of them an
old prefill's KV never goes to a new decode that cannot see it (it would wait, then recompute).
They say ``X-UCM-Store: degraded`` there while their store does not answer: they keep serving, but a
prefill's KV cannot reach a decode through that store, so PD requests avoid such prefills and go
straight to decode when no other is left.

Load is what the engine reports (vLLM's running and waiting requests, read from its ``/metrics``
every ``routing.engine_metrics_interval_s``: every proxy replica's requests) plus what this proxy
sent it since that reading; this proxy's own in-flight count where the engine reports nothing.
``least_outstanding`` takes the least loaded (then the emptiest KV cache); ``prefix_affinity`` ranks
backends per prompt prefix by rendezvous hashing (a backend joining or leaving moves only the
prefixes it takes or held) and takes the first whose load is within ``load_factor`` of the pool's
average: consistent hashing with bounded load. ``kv_aware`` takes, among the backends within that
same load bound, the one whose cached prefix of the prompt (from the engines' KV events,
``ucm_proxy.kvindex``) minus ``kv_aware_load_tokens`` per outstanding request is largest; with
nothing cached anywhere, the least loaded.

A request that finds no backend available may wait (``Pool.wait_available``) for one to come back:
a health check passing again, discovery adding an endpoint, or an ejection ending wakes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import math
import time
from collections.abc import Iterable, Mapping

from ucm_proxy import metrics
from ucm_proxy.config import HealthConfig, Policy, RoutingConfig


class Backend:
    __slots__ = (
        "consecutive_failures",
        "ejected_until",
        "ejections",
        "engine_kv_usage",
        "engine_load",
        "healthy",
        "identity",
        "in_flight",
        "in_flight_at_reading",
        "in_flight_gauge",
        "key",
        "role",
        "store_degraded",
        "url",
    )

    def __init__(self, url: str, role: str) -> None:
        self.url = url
        self.role = role
        self.in_flight = 0
        self.in_flight_gauge = metrics.IN_FLIGHT.labels(url, role)  # looked up once: it changes twice a request
        self.healthy = True  # optimistic until the first check: serving starts at once
        self.consecutive_failures = 0
        self.ejected_until = 0.0
        self.ejections = 0
        self.identity: str | None = None  # its pairing identity, from its last health check (None: unknown)
        self.store_degraded = False  # its last health check said its KV store is not answering
        self.key = hashlib.blake2b(url.encode(), digest_size=8).digest()
        self.engine_load: float | None = None  # running + waiting at the last reading of its /metrics
        self.engine_kv_usage = 0.0
        self.in_flight_at_reading = 0

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def read_engine(self, load: float | None, kv_usage: float = 0.0) -> None:
        """The engine's own figures (None: it reported none)."""
        self.engine_load, self.engine_kv_usage, self.in_flight_at_reading = load, kv_usage, self.in_flight

    @property
    def load(self) -> float:
        if self.engine_load is None:
            return self.in_flight
        return max(self.in_flight, self.engine_load + self.in_flight - self.in_flight_at_reading)

    def __repr__(self) -> str:
        return f"Backend({self.url}, {self.role}, in_flight={self.in_flight}, healthy={self.healthy})"


class Pool:
    """The backends of one role and the policy that picks among them."""

    def __init__(self, role: str, urls: Iterable[str], policy: Policy, routing: RoutingConfig, health: HealthConfig):
        self.role = role
        self.policy = policy
        self.routing = routing
        self.health = health
        self.backends: list[Backend] = []
        # Pods of the pool that exist but are not ready, as discovery sees them; None where the list is
        # configured (a configured pool without backends is a configuration, not a pool at zero).
        self.starting: int | None = None
        self._rr = itertools.count()
        self._changed: asyncio.Event | None = None  # made by the first waiter, set and dropped on news
        # Exported at 0 from the start: Prometheus' increase() cannot see a series' first sample, so
        # a count born at 1 would hide the request that finds a pool scaled to zero (what wakes it).
        metrics.UNSERVED.labels(role)
        self.set_urls(urls)

    def set_urls(self, urls: Iterable[str], starting: int | None = None) -> None:
        """Replace the member list (discovery, which also says how many pods are ``starting``),
        keeping the state of backends that stay; the metric series of backends that left go with them."""
        self.starting = starting
        current = {b.url: b for b in self.backends}
        self.backends = [current.get(u) or Backend(u, self.role) for u in dict.fromkeys(urls)]
        kept = {b.url for b in self.backends}
        for url in set(current) - kept:
            metrics.forget_backend(url, self.role)
        for b in self.backends:
            metrics.BACKEND_HEALTHY.labels(b.url, self.role).set(1 if b.healthy else 0)
        if kept - current.keys():  # a new endpoint: requests waiting for one may go
            self._notify()

    @property
    def at_zero(self) -> bool:
        """Discovery finds no pod of the pool at all, ready or starting: it is scaled to zero (or its
        pods cannot be scheduled, which the resource's pool conditions tell)."""
        return not self.backends and self.starting == 0

    def available(self, exclude: frozenset[str] = frozenset()) -> list[Backend]:
        now = time.monotonic()
        return [b for b in self.backends if b.available(now) and b.url not in exclude]

    def pick(
        self,
        affinity_key: bytes | None = None,
        exclude: frozenset[str] = frozenset(),
        hits: Mapping[str, float] | None = None,
    ) -> Backend | None:
        """``hits``: for kv_aware, the prompt tokens each backend would not compute (``ucm_proxy.kvroute``)."""
        candidates = self.available(exclude)
        if not candidates:
            return None
        if self.policy == "round_robin":
            return candidates[next(self._rr) % len(candidates)]
        if self.policy == "prefix_affinity" and affinity_key is not None:
            ranked = sorted(
                candidates, key=lambda b: hashlib.blake2b(affinity_key + b.key, digest_size=8).digest(), reverse=True
            )
            cap = self._load_cap(candidates)
            owner = next((b for b in ranked if b.load + 1 <= cap), None)
            if owner is not None:
                return owner
        if self.policy == "kv_aware" and hits and any(hits.get(b.url, 0) for b in candidates):
            cap = self._load_cap(candidates)
            within = [b for b in candidates if b.load + 1 <= cap] or candidates
            weight = self.routing.kv_aware_load_tokens
            chosen = max(within, key=lambda b: (hits.get(b.url, 0) - weight * b.load, -b.load, -b.engine_kv_usage))
            metrics.child(metrics.KV_ROUTING, "hit" if hits.get(chosen.url, 0) else "no_hits").inc()
            metrics.KV_PREDICTED_HIT_TOKENS.inc(hits.get(chosen.url, 0))
            return chosen
        if self.policy == "kv_aware" and hits is not None:
            metrics.child(metrics.KV_ROUTING, "no_hits").inc()
        return min(candidates, key=lambda b: (b.load, b.engine_kv_usage))

    def _load_cap(self, candidates: list[Backend]) -> int:
        """The most a backend may carry to be chosen for what it holds: ``load_factor`` times the
        average with this request (consistent hashing with bounded load)."""
        return math.ceil(self.routing.load_factor * (sum(b.load for b in candidates) + 1) / len(candidates))

    # -- passive health --------------------------------------------------------------------------
    def record_success(self, backend: Backend) -> None:
        backend.consecutive_failures = 0
        backend.ejections = 0  # it serves again: the next ejection starts from the first backoff

    def record_failure(self, backend: Backend) -> None:
        backend.consecutive_failures += 1
        if backend.consecutive_failures >= self.health.eject_after:
            backoff = min(self.health.backoff_s * 2**backend.ejections, self.health.backoff_max_s)
            backend.ejected_until = time.monotonic() + backoff
            backend.ejections += 1
            backend.consecutive_failures = 0
            metrics.EJECTIONS.labels(backend.url, self.role).inc()

    # -- active health ---------------------------------------------------------------------------
    def record_check(self, backend: Backend, ok: bool) -> None:
        came_back = ok and not backend.healthy
        backend.healthy = ok
        if came_back:
            self._notify()
        metrics.BACKEND_HEALTHY.labels(backend.url, self.role).set(1 if backend.healthy else 0)

    # -- waiting for a backend -------------------------------------------------------------------
    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()  # wakes every waiter; the next one makes a fresh event
            self._changed = None

    async def wait_available(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until some backend is available; False if none became so."""
        deadline = time.monotonic() + timeout_s
        if not self.available():
            metrics.UNSERVED.labels(self.role).inc()
        metrics.WAITING.labels(self.role).inc()
        try:
            while not self.available():
                now = time.monotonic()
                if now >= deadline:
                    return False
                # Ejections end on their own, with no check to announce it.
                ends = [b.ejected_until for b in self.backends if b.healthy and b.ejected_until > now]
                if self._changed is None:
                    self._changed = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min([deadline, *ends]) - now)
            return True
        finally:
            metrics.WAITING.labels(self.role).dec()


IDENTITY_HEADER = "X-UCM-KV-Identity"
STORE_HEADER = "X-UCM-Store"  # "degraded; ..." while the engine's KV store does not answer


def store_degraded(pool: Pool) -> frozenset[str]:
    """URLs of the pool's backends whose KV store is degraded: a prefill among them cannot pass its
    KV to a decode (it serves on, computing what it cannot load)."""
    return frozenset(b.url for b in pool.backends if b.store_degraded)


def unpaired(prefill: Pool, decode: Pool) -> frozenset[str]:
    """URLs of prefill backends that no available decode can share KV with. Unknown identities
    (engines not started by ``ucm serve``) pair with anything."""
    identities = {b.identity for b in decode.available()}
    if None in identities:
        return frozenset()
    return frozenset(b.url for b in prefill.backends if b.identity is not None and b.identity not in identities)


def other_identities(pool: Pool, identity: str | None) -> frozenset[str]:
    """URLs of the pool's backends whose known identity differs from ``identity``."""
    if identity is None:
        return frozenset()
    return frozenset(b.url for b in pool.backends if b.identity is not None and b.identity != identity)


# What an engine's /metrics says about its load: vLLM's gauges, summed over its engines (data parallel).
_LOAD_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_KV_SERIES = "vllm:kv_cache_usage_perc"


def engine_figures(text: str) -> tuple[float | None, float]:
    """(running + waiting requests, the fullest KV cache) from a vLLM /metrics page; load None
    when the page has neither series (not a vLLM engine)."""
    load, kv, seen = 0.0, 0.0, False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _LOAD_SERIES:
            seen = True
            load += float(line.rsplit(" ", 1)[1])
        elif name == _KV_SERIES:
            kv = max(kv, float(line.rsplit(" ", 1)[1]))
    return (load if seen else None), kv
