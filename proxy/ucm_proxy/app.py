"""The OpenAI-compatible PD proxy: the request path and its two front doors.

``POST /v1/completions`` and ``/v1/chat/completions`` take the hot path: answered on the socket
without ASGI (``server``, ``exchange``: no router, middleware or validation models per request),
a lean HTTP/1.1 client on kept-alive connections (``http1``), the client's body bytes forwarded
to decode with ``kv_transfer_params`` spliced in rather than re-encoded, and stream chunks passed
through as they arrive. FastAPI serves the rest (models, health, readiness, PD path, metrics).

PD mode: the prefill backend gets a copy of the request's prompt fields (``requests.prefill_body``)
with ``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true}``; the
decode backend gets the original request plus the ``kv_transfer_params`` prefill returned. Mixed
mode sends whole requests.

Request bodies are read and written in ``requests``, errors shaped in ``errors``, upstream
requests and stream relaying live in ``relay``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ucm_proxy import http1, metrics
from ucm_proxy.answers import Answer
from ucm_proxy.backends import (
    IDENTITY_HEADER,
    STORE_HEADER,
    Backend,
    Pool,
    engine_figures,
    other_identities,
    store_degraded,
    unpaired,
)
from ucm_proxy.config import ProxyConfig, read_backends_file
from ucm_proxy.decider import Decider
from ucm_proxy.errors import NoBackend, Passthrough, ProxyError, Retry
from ucm_proxy.exchange import Exchange
from ucm_proxy.http1 import Client, TooLarge, UpstreamError
from ucm_proxy.keys import ApiKeys, bearer
from ucm_proxy.kvevents import Followers
from ucm_proxy.kvroute import KVRouter
from ucm_proxy.models import Card, Models, read_cards
from ucm_proxy.pdpath import PARAM_BLOCKS, PathChecker, RecentPaths
from ucm_proxy.relay import Stream, Upstream, relay_chunks
from ucm_proxy.requests import (
    affinity_key,
    engine_body,
    parse_body,
    prefill_body,
    with_cache_salt,
    with_params,
)

logger = logging.getLogger("ucm_proxy")
T = TypeVar("T")


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        routing, health = config.routing, config.health
        urls = {"prefill": config.prefill, "decode": config.decode}
        if config.backends_file is not None:
            urls = read_backends_file(config.backends_file)
        self.prefill = Pool("prefill", [], routing.prefill, routing, health)
        self.decode = Pool("decode", [], routing.decode, routing, health)
        kv_events = routing.kv_events
        self.followers = Followers(kv_events) if kv_events is not None else None
        self.kv_router: KVRouter | None = None
        self.set_backends(urls)
        self.keys = ApiKeys(config.api_keys, config.api_keys_file)
        # Not the clients' keys: a tenant's key must not read the counters of every tenant.
        self.scrape_tokens = ApiKeys([], config.metrics_token_file) if config.metrics_token_file else None
        self.models = Models()
        self.recent = RecentPaths()
        split = config.disaggregation
        self.decider = Decider(
            split.min_prefill_tokens, split.chars_per_token, split.remembered_chunks, split.balance_gap
        )
        self.first_health_round = asyncio.Event()
        checks = config.mode == "pd" and config.pd_check.interval_s > 0
        self.path_checker = PathChecker(self, config.pd_check) if checks else None
        self.session: aiohttp.ClientSession | None = None  # health checks, engine metrics, path checks
        self.client: Client | None = None  # the requests being served
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
        key = self.config.backend_key()
        auth = {"Authorization": f"Bearer {key}"} if key else {}  # on every backend call, probes included
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False, headers=auth)
        self.client = Client(auth)
        if self.followers is not None:
            routing = self.config.routing
            self.kv_router = KVRouter(
                self.followers, self.session, self.config.timeouts.connect_s, routing.kv_aware_store_weight
            )
            self._follow()
        self._tasks.append(asyncio.create_task(self._health_loop()))
        if self.config.routing.engine_metrics_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._engine_metrics_loop()))
        if self.config.backends_file is not None:
            from ucm_proxy.discovery import watch_backends_file

            self._tasks.append(asyncio.create_task(watch_backends_file(self, self.config.backends_file)))
        if self.config.discovery is not None:
            from ucm_proxy.discovery import watch_endpoints, write_pd_path

            self._tasks.append(asyncio.create_task(watch_endpoints(self, self.config.discovery)))
            if self.path_checker is not None and self.config.discovery.resource:
                self.path_checker.listeners.append(write_pd_path(self, self.config.discovery))
        if self.path_checker is not None:
            self._tasks.append(asyncio.create_task(self.path_checker.run()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.followers is not None:
            await self.followers.close()
        if self.session is not None:
            await self.session.close()
        if self.client is not None:
            self.client.close()

    def set_backends(self, urls: dict[str, list[str]]) -> None:
        """The pools' members (mixed mode: every backend serves whole requests)."""
        if self.config.mode == "mixed":
            self.decode.set_urls([*urls["decode"], *urls["prefill"]])
        else:
            self.prefill.set_urls(urls["prefill"])
            self.decode.set_urls(urls["decode"])
        if self.kv_router is not None:  # started: following runs in the event loop
            self._follow()

    def _follow(self) -> None:
        """Follow the KV events of the engines kv_aware routes among."""
        assert self.followers is not None
        self.followers.follow(b.url for p in self.pools if p.policy == "kv_aware" for b in p.backends)

    @property
    def pools(self) -> list[Pool]:
        return [p for p in (self.prefill, self.decode) if p.backends]

    async def check_health(self) -> None:
        """One round of active checks; also refreshes the served models (base models and adapters)."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.timeouts.connect_s)
        answers: list[dict[str, Card]] = []

        async def check(pool: Pool, backend: Backend) -> None:
            ok = False
            try:
                async with self.session.get(backend.url + self.config.health.path, timeout=timeout) as r:
                    ok = r.status == 200
                    if ok:
                        backend.identity = r.headers.get(IDENTITY_HEADER)
                        backend.store_degraded = r.headers.get(STORE_HEADER, "").startswith("degraded")
                        metrics.BACKEND_STORE_DEGRADED.labels(backend.url, pool.role).set(int(backend.store_degraded))
                if ok:
                    async with self.session.get(backend.url + "/v1/models", timeout=timeout) as r:
                        if r.status == 200:
                            answers.append(read_cards(await r.json()))
            except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
                pass
            pool.record_check(backend, ok)

        await asyncio.gather(*(check(p, b) for p in self.pools for b in list(p.backends)))
        self.models.update(answers)

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:
                logger.exception("health check round failed")
            self.first_health_round.set()
            # While a backend is down, look more often: a restarted engine serves as soon as it is up.
            down = any(not b.healthy for p in self.pools for b in p.backends)
            health = self.config.health
            await asyncio.sleep(min(health.interval_s, health.unhealthy_interval_s) if down else health.interval_s)

    async def read_engines(self) -> None:
        """One reading of every backend's /metrics: the load the engine itself reports."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.timeouts.connect_s)

        async def read(pool: Pool, backend: Backend) -> None:
            figures: tuple[float | None, float] = (None, 0.0)
            try:
                async with self.session.get(backend.url + "/metrics", timeout=timeout) as r:
                    if r.status == 200:
                        figures = engine_figures(await r.text())
            except (TimeoutError, aiohttp.ClientError, ValueError, IndexError):
                pass  # no reading: its load is this proxy's own count until the next one
            backend.read_engine(*figures)
            metrics.ENGINE_LOAD.labels(backend.url, pool.role).set(backend.load)

        await asyncio.gather(*(read(p, b) for p in self.pools for b in p.available()))

    async def _engine_metrics_loop(self) -> None:
        while True:
            try:
                await self.read_engines()
            except Exception:
                logger.exception("reading the engines' metrics failed")
            await asyncio.sleep(self.config.routing.engine_metrics_interval_s)

    def ready(self) -> bool:
        if not self.decode.available():
            return False
        return self.config.mode == "mixed" or bool(self.prefill.available()) or self.config.fallback_to_decode

    # -- the request path ------------------------------------------------------------------------
    async def handle(self, exchange: Exchange) -> Answer | Stream:
        started = time.perf_counter()
        request_id = exchange.header(b"x-request-id") or secrets.token_hex(16)
        status, trace = 500, Trace()
        try:
            response = await self._handle(exchange, request_id, started, trace)
            status = response.status
            return response
        except ProxyError as exc:
            status = exc.status
            return exc.answer(request_id)
        except Passthrough as p:  # a backend's 4xx about the client's request, as it was
            status = p.status
            return Answer(p.status, p.body, {"X-Request-Id": request_id})
        finally:
            metrics.child(metrics.REQUESTS, exchange.route, str(status), trace.path).inc()
            metrics.child(metrics.LATENCY, exchange.route).observe(time.perf_counter() - started)
            if trace.path != "none":
                self.recent.record(trace.path)

    async def _handle(self, exchange: Exchange, request_id: str, started: float, trace: Trace) -> Answer | Stream:
        route = exchange.route
        client_key = self.authorize(exchange.header(b"authorization"))
        raw = await self._read_body(exchange)
        body = parse_body(raw, route)
        raw, body = with_cache_salt(raw, body, self.config.cache_salt, client_key)
        if self.models and body["model"] not in self.models:
            raise ProxyError(404, f"The model `{body['model']}` does not exist.", "model")
        # The client's Authorization is for the proxy: engines get the deployment's own key (or none).
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        affinity = affinity_key(body, route, self.config.routing.prefix_chars)
        hint = Hint(affinity, route, body, self.models.adapter(body["model"]))
        return await exchange.unless_client_leaves(self._serve(route, raw, body, headers, hint, started, trace))

    async def _serve(
        self,
        route: str,
        raw: bytes,
        body: dict[str, Any],
        headers: dict[str, str],
        hint: Hint,
        started: float,
        trace: Trace,
    ) -> Answer | Stream:
        decode_body, promised, pair, chunks = engine_body(raw, body), 0, None, []
        trace.path = "decode_only"
        if self.config.mode == "pd":
            decision, chunks = self.decider.decide(body, route, self._pools_gap)
            metrics.child(metrics.DISAGGREGATION, decision.reason).inc()
            trace.path = "direct"
            if decision.disaggregate:
                prefilled = await self._prefill(route, body, headers, hint)
                trace.path = "fallback" if prefilled is None else "pd"
                if prefilled is not None:
                    params, identity = prefilled
                    pair = Pair(identity, other_identities(self.decode, identity))
                    decode_body = with_params(raw, body, params)
                    blocks = params.get(PARAM_BLOCKS) if isinstance(params, dict) else None
                    promised = blocks if isinstance(blocks, int) else 0
        if body.get("stream"):
            response = await self._decode_stream(route, decode_body, headers, hint, started, pair)
        else:
            response = await self._decode(route, decode_body, headers, hint, started, promised, pair)
        if response.status == 200:
            self.decider.remember(chunks)  # prefill, or decode as it computed them, stored its blocks
        return response

    def _pools_gap(self) -> float:
        """How much busier prefill is than decode: their least loaded engines' loads apart."""
        prefill, decode = self.prefill.available(), self.decode.available()
        if not prefill or not decode:
            return 0.0
        return min(b.load for b in prefill) - min(b.load for b in decode)

    def authorize(self, authorization: str | None) -> str | None:
        """The client's API key, from its Authorization header (None when the proxy takes none);
        401 for a wrong or missing one, and for every request while the key file holds none."""
        if not self.keys.required:
            return None
        token = bearer(authorization, self.keys.current())
        if token is None:
            raise ProxyError(
                401, "Invalid or missing API key (Authorization: Bearer <key>).", None, "authentication_error"
            )
        return token

    def authorize_scrape(self, authorization: str | None) -> None:
        """/metrics and /pd-path: 401 without the scrape token, when the proxy has one."""
        if self.scrape_tokens is not None and bearer(authorization, self.scrape_tokens.current()) is None:
            metrics.child(metrics.REJECTED, "scrape_token").inc()
            raise ProxyError(
                401, "Invalid or missing metrics token (Authorization: Bearer <token>).", None, "authentication_error"
            )

    async def _read_body(self, exchange: Exchange) -> bytes:
        limit = self.config.max_body_bytes
        if not exchange.more_body:  # the whole body came with the headers (most requests): no timer
            return await exchange.read_body(limit)
        try:
            async with asyncio.timeout(self.config.timeouts.body_s):  # a stalled upload holds nothing long
                return await exchange.read_body(limit)
        except TimeoutError:
            metrics.child(metrics.REJECTED, "body_timeout").inc()
            raise ProxyError(408, f"Request body not received within {self.config.timeouts.body_s} s.") from None

    async def _prefill(
        self, route: str, body: dict[str, Any], headers: dict[str, str], hint: Hint
    ) -> tuple[Any, str | None] | None:
        """kv_transfer_params from a prefill backend and that backend's pairing identity; None when
        decode must do it all (fallback)."""
        payload = prefill_body(body, route)
        avoid = unpaired(self.prefill, self.decode) | store_degraded(self.prefill)
        if avoid and not self.prefill.available(avoid):
            # No prefill can pass KV to a decode (mid-rollout none matches one, or their store does
            # not answer): decode serves alone.
            return None

        async def attempt(backend: Backend) -> tuple[Any, str | None]:
            async with (
                asyncio.timeout(self.config.timeouts.prefill_s),
                self._post(backend, route, payload, headers) as resp,
            ):
                if resp.status >= 500:
                    raise Retry(f"prefill {backend.url} answered {resp.status}")
                try:
                    data = await resp.read(self.config.max_response_bytes)
                except TooLarge:  # a one-token answer this large: that backend is broken
                    raise Retry(f"prefill {backend.url} answered more than max_response_bytes") from None
                if resp.status >= 400:  # the client's request is wrong: say so, don't retry
                    raise Passthrough(resp.status, data)
                try:
                    params = json.loads(data).get("kv_transfer_params")
                except (ValueError, AttributeError):
                    raise Retry(f"prefill {backend.url} answered a non-JSON body") from None
                return params or {}, backend.identity

        # With a fallback, decode serves at once rather than after a wait for prefill.
        queue_s = 0.0 if self.config.fallback_to_decode else None
        try:
            return await self._with_retries(self.prefill, hint, attempt, queue_s, avoid)
        except NoBackend:
            if self.config.fallback_to_decode:
                return None
            raise no_backend("prefill") from None

    async def _decode(
        self,
        route: str,
        payload: bytes,
        headers: dict[str, str],
        hint: Hint,
        started: float,
        promised: int,
        pair: Pair | None,
    ) -> Answer:
        async def attempt(backend: Backend) -> Answer:
            # A whole answer arrives at once, after generation: only first_byte_s bounds it (an idle
            # limit would retry a long generation on another backend).
            upstream = self._post(backend, route, payload, headers)
            async with asyncio.timeout(self.config.timeouts.first_byte_s):
                resp = await upstream.__aenter__()
            try:
                if resp.status >= 500:
                    raise Retry(f"decode {backend.url} answered {resp.status}")
                try:
                    data = await resp.read(self.config.max_response_bytes)
                except TooLarge:  # another backend would answer as much: the client must stream it
                    raise ProxyError(
                        502,
                        f"The answer is larger than the proxy's max_response_bytes ({self.config.max_response_bytes} "
                        "bytes); ask for it with stream: true.",
                        kind="upstream_error",
                    ) from None
                if resp.status == 200 and ABORTED.search(data):
                    raise Retry(f"decode {backend.url} aborted the request")
            finally:
                await upstream.__aexit__(None, None, None)
            metrics.child(metrics.TTFB, route).observe(time.perf_counter() - started)
            if pair is not None:
                pair.record(backend)
            if resp.status == 200:
                self.recent.record_decode(promised, data)
            content_type = resp.headers.get("content-type", "application/json")
            return Answer(resp.status, data, _response_headers(resp, headers), content_type)

        try:
            return await self._with_retries(self.decode, hint, attempt, avoid=pair.avoid if pair else frozenset())
        except NoBackend:
            raise no_backend("decode") from None

    async def _decode_stream(
        self, route: str, payload: bytes, headers: dict[str, str], hint: Hint, started: float, pair: Pair | None
    ) -> Stream:
        """Commit to a backend only once its first chunk arrives: failures before that are retried."""

        async def attempt(backend: Backend) -> Stream:
            upstream = self._post(backend, route, payload, headers, idle_s=self.config.timeouts.idle_s)
            try:
                async with asyncio.timeout(self.config.timeouts.first_byte_s):
                    resp = await upstream.__aenter__()
                    if resp.status >= 500:
                        raise Retry(f"decode {backend.url} answered {resp.status}")
                    first = await resp.chunk()
                if not first and resp.status == 200:
                    raise Retry(f"decode {backend.url} closed the stream before any data")
                if resp.status == 200 and ABORTED.search(first):
                    raise Retry(f"decode {backend.url} aborted the request")
            except BaseException:
                await upstream.__aexit__(None, None, None)
                raise
            metrics.child(metrics.TTFB, route).observe(time.perf_counter() - started)
            if pair is not None:
                pair.record(backend)
            upstream.hold()  # in flight until the stream ends
            return Stream(
                upstream,
                relay_chunks(upstream, resp, first),
                resp.status,
                _response_headers(resp, headers),
                resp.headers.get("content-type", "text/event-stream"),
            )

        try:
            return await self._with_retries(self.decode, hint, attempt, avoid=pair.avoid if pair else frozenset())
        except NoBackend:
            raise no_backend("decode") from None

    async def _with_retries(
        self,
        pool: Pool,
        hint: Hint,
        attempt: Callable[[Backend], Awaitable[T]],
        queue_s: float | None = None,
        avoid: frozenset[str] = frozenset(),
    ) -> T:
        """``attempt`` on one backend after another (up to ``retries`` more) until one answers. A pool
        with none available is waited on for ``queue_s`` (default ``timeouts.queue_s``) first; a
        backend that failed this request is not waited for. ``avoid``: backends never to use."""
        if queue_s is None:
            queue_s = self.config.timeouts.queue_s
        exclude: set[str] = set(avoid)
        hits = None
        if pool.policy == "kv_aware" and self.kv_router is not None:
            hits = await self.kv_router.hits(pool, hint.route, hint.body, hint.adapter)
        for n in range(self.config.retries + 1):
            backend = pool.pick(hint.affinity, frozenset(exclude), hits)
            if backend is None and exclude == avoid and await pool.wait_available(queue_s):
                backend = pool.pick(hint.affinity, avoid, hits)
            if backend is None:
                break
            if n:
                metrics.RETRIES.labels(pool.role).inc()
            try:
                result = await attempt(backend)
            except Passthrough:
                pool.record_success(backend)
                raise
            except (TimeoutError, Retry, UpstreamError) as exc:
                logger.warning("%s backend %s failed: %s", pool.role, backend.url, exc or type(exc).__name__)
                pool.record_failure(backend)
                exclude.add(backend.url)
                continue
            pool.record_success(backend)
            return result
        raise NoBackend

    def _post(
        self, backend: Backend, route: str, payload: bytes, headers: dict[str, str], idle_s: float | None = None
    ) -> Upstream:
        assert self.client is not None
        return Upstream(self.client, backend, route, payload, headers, self.config.timeouts.connect_s, idle_s)


@dataclass(frozen=True)
class Hint:
    """What routing weighs for one request: the digest of its prompt's start (prefix_affinity), its
    route and body (kv_aware tokenizes the prompt), and the LoRA adapter it runs, if any (kv_aware
    matches only blocks the engines stored with it)."""

    affinity: bytes
    route: str
    body: dict[str, Any]
    adapter: str | None


class Pair:
    """A PD request's prefill identity, and the decodes that could not use its KV."""

    __slots__ = ("avoid", "identity")

    def __init__(self, identity: str | None, avoid: frozenset[str]) -> None:
        self.identity, self.avoid = identity, avoid

    def record(self, decode: Backend) -> None:
        known = self.identity is not None and decode.identity is not None
        metrics.child(metrics.PD_PAIRS, str(decode.identity == self.identity).lower() if known else "unknown").inc()


class Trace:
    """What a request's handling learned along the way, for its metrics."""

    __slots__ = ("path",)

    def __init__(self) -> None:
        self.path = "none"  # refused before routing; else pd, direct, fallback or decode_only


# vLLM answers a request it aborted before any token (one that arrived while it shut down, say) with
# a 200 and no text; nothing was generated, so another backend may serve it. In JSON a quote inside
# a string is escaped, so this matches a real field only. A chat stream's first chunk is the role
# alone: an abort after it is relayed (the engine's drain middleware refuses such requests first).
ABORTED = re.compile(rb'"finish_reason"\s*:\s*"abort"')


def no_backend(role: str) -> ProxyError:
    return ProxyError(503, f"No {role} backend is available; retry shortly.", headers={"Retry-After": "1"})


def _response_headers(resp: http1.Response, sent: dict[str, str]) -> dict[str, str]:
    return {"X-Request-Id": resp.headers.get("x-request-id", sent["X-Request-Id"])}


class ProxyApp:
    """The proxy's two front doors: the hot routes (``HOT_ROUTES``) are answered on the socket by
    ``serve`` (``server`` hands it each such request as an ``Exchange``, no ASGI), everything else
    by the FastAPI app ``api``.

    A request holds the body bytes that have arrived, from when they arrive until its answer ends:
    all requests' within ``max_in_flight_bytes``, one client's (the peer address,
    ``server.client_key``) within its share; a body that would pass either is refused (429) as it
    arrives. An upload that sends nothing holds nothing. (Reserving a body's Content-Length, or
    ``max_body_bytes`` for a chunked one, before reading it let 16 idle uploads from 16 addresses
    hold the whole default budget and refuse everyone else until ``timeouts.body_s`` cut them off:
    ``benchmarks/proxy_attack.py``.) A connection is served one request at a time (a pipelined one
    waits, reading paused), so it holds one body at most: ``max_body_bytes``."""

    HOT_ROUTES = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, proxy: Proxy, api: FastAPI) -> None:
        self.proxy = proxy
        self.api = api
        self.in_flight = 0  # client requests being handled, streams until their last byte
        self.in_flight_bytes = 0  # their bodies, as reserved
        self.client_bytes: dict[str, int] = {}  # the same per client; a client holding none has no entry

    def _refusal(self, client: str, more: int) -> str | None:
        """Why ``client`` cannot hold ``more`` body bytes now (None: it can)."""
        config = self.proxy.config
        if self.client_bytes.get(client, 0) + more > config.client_bytes:
            return "client_bytes"
        if self.in_flight_bytes + more > config.max_in_flight_bytes:
            return "in_flight_bytes"
        return None

    def _hold(self, client: str, n: int) -> None:
        self.in_flight_bytes += n
        left = self.client_bytes.pop(client, 0) + n
        if left:
            self.client_bytes[client] = left  # the map holds only clients that hold bytes

    async def serve(self, exchange: Exchange) -> None:
        client = exchange.client
        held = len(exchange.body)
        refusal = "in_flight" if self.in_flight >= self.proxy.config.max_in_flight else self._refusal(client, held)
        if refusal is not None:
            metrics.child(metrics.REQUESTS, exchange.route, "429", "none").inc()
            await exchange.send(_budget_refusal(refusal, exchange).answer())
            return

        def arrived(total: int) -> None:
            nonlocal held
            if total > held:
                why = self._refusal(client, total - held)
                if why is not None:
                    raise _budget_refusal(why, exchange)
                self._hold(client, total - held)
                held = total

        self.in_flight += 1
        self._hold(client, held)
        exchange.on_body = arrived
        try:
            try:
                response = await self.proxy.handle(exchange)
            except Exception:
                logger.exception("unexpected error on %s", exchange.route)
                response = ProxyError(500, "Internal proxy error.", None, "internal_error").answer()
            await exchange.send(response)
        finally:
            exchange.on_body = None
            self.in_flight -= 1
            self._hold(client, -held)


def _budget_refusal(why: str, exchange: Exchange) -> ProxyError:
    """The 429 for a request the budget cannot take (counted under ``why``)."""
    metrics.child(metrics.REJECTED, why).inc()
    message = "The proxy is at its request limit; retry shortly."
    if why == "client_bytes":
        message = "This client's requests hold their share of the proxy's request budget; retry shortly."
        exchange.keep_alive = False  # it has connections enough: one fewer held open
    return ProxyError(429, message, headers={"Retry-After": "1"})


def create_app(config: ProxyConfig) -> ProxyApp:
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    # No /docs or /openapi.json: the API is OpenAI's, and an unauthenticated page describing it
    # helps nobody but a prober.
    api = FastAPI(title="UCM PD proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            proxy.authorize(request.headers.get("authorization"))
        except ProxyError as exc:
            return exc.response()
        # What the health checks last learned: a call never triggers a round of backend requests.
        return JSONResponse({"object": "list", "data": proxy.models.listing()})

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready() -> Response:
        if proxy.ready():
            return JSONResponse({"status": "ready"})
        return ProxyError(503, "Not ready: no healthy backend for a needed role.").response()

    # Backend addresses and counts, no request content: open unless metrics_token_file is set.
    @api.get("/pd-path")
    async def pd_path(request: Request) -> Response:
        try:
            proxy.authorize_scrape(request.headers.get("authorization"))
        except ProxyError as exc:
            return exc.response()
        checker = proxy.path_checker
        return JSONResponse(proxy.recent.report(checker.last if checker is not None else None))

    @api.get("/metrics")
    async def prometheus(request: Request) -> Response:
        try:
            proxy.authorize_scrape(request.headers.get("authorization"))
        except ProxyError as exc:
            return exc.response()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return ProxyApp(proxy, api)
