"""The OpenAI-compatible PD proxy.

``POST /v1/completions`` and ``/v1/chat/completions`` take the hot path: raw ASGI in front of
FastAPI (no router, middleware or validation models per request), one shared aiohttp session, the client's body bytes
forwarded to decode with ``kv_transfer_params`` spliced in rather than re-encoded, and stream
chunks passed through as they arrive. FastAPI serves the rest (models, health, readiness, metrics,
OpenAPI docs).

PD mode: the prefill backend gets a copy of the request with ``max_tokens=1``, ``stream=false``
and ``kv_transfer_params={"do_remote_decode": true}``; the decode backend gets the original
request plus the ``kv_transfer_params`` prefill returned. Mixed mode sends whole requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aiohttp
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ucm_proxy import metrics
from ucm_proxy.backends import Backend, Pool
from ucm_proxy.config import ProxyConfig

logger = logging.getLogger("ucm_proxy")
T = TypeVar("T")


class ProxyError(Exception):
    """An error answered to the client as an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "service_unavailable")

    def response(self, request_id: str | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        headers = {"X-Request-Id": request_id} if request_id else None
        return JSONResponse(body, status_code=self.status, headers=headers)


class _Retry(Exception):
    """This backend failed before answering; try another."""


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        routing, health = config.routing, config.health
        if config.mode == "mixed":
            self.prefill = Pool("prefill", [], routing.prefill, routing, health)
            self.decode = Pool("decode", [*config.decode, *config.prefill], routing.decode, routing, health)
        else:
            self.prefill = Pool("prefill", config.prefill, routing.prefill, routing, health)
            self.decode = Pool("decode", config.decode, routing.decode, routing, health)
        self.keys = config.accepted_keys()
        self.models: set[str] = set()
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        t = config.timeouts
        self._prefill_timeout = aiohttp.ClientTimeout(total=t.prefill_s, sock_connect=t.connect_s)
        self._decode_timeout = aiohttp.ClientTimeout(sock_connect=t.connect_s, sock_read=t.idle_s)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self._tasks.append(asyncio.create_task(self._health_loop()))
        if self.config.discovery is not None:
            from ucm_proxy.discovery import watch_endpoints

            self._tasks.append(asyncio.create_task(watch_endpoints(self, self.config.discovery)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()

    @property
    def pools(self) -> list[Pool]:
        return [p for p in (self.prefill, self.decode) if p.backends]

    async def check_health(self) -> None:
        """One round of active checks; also refreshes the served model names."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.timeouts.connect_s)
        models: set[str] = set()

        async def check(pool: Pool, backend: Backend) -> None:
            ok = False
            try:
                async with self.session.get(backend.url + self.config.health.path, timeout=timeout) as r:
                    ok = r.status == 200
                if ok:
                    async with self.session.get(backend.url + "/v1/models", timeout=timeout) as r:
                        if r.status == 200:
                            models.update(m["id"] for m in (await r.json()).get("data", []) if "id" in m)
            except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
                pass
            pool.record_check(backend, ok)

        await asyncio.gather(*(check(p, b) for p in self.pools for b in list(p.backends)))
        if models:
            self.models = models

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:
                logger.exception("health check round failed")
            await asyncio.sleep(self.config.health.interval_s)

    def ready(self) -> bool:
        if not self.decode.available():
            return False
        return self.config.mode == "mixed" or bool(self.prefill.available()) or self.config.fallback_to_decode

    # -- the request path ------------------------------------------------------------------------
    async def handle(self, request: Request, route: str) -> Response:
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        status = 500
        try:
            response = await self._handle(request, route, request_id, started)
            status = response.status_code
            return response
        except ProxyError as exc:
            status = exc.status
            return exc.response(request_id)
        except _Passthrough as p:  # a backend's 4xx about the client's request, as it was
            status = p.status
            return Response(p.body, p.status, media_type="application/json", headers={"X-Request-Id": request_id})
        finally:
            metrics.REQUESTS.labels(route, str(status)).inc()
            metrics.LATENCY.labels(route).observe(time.perf_counter() - started)

    async def _handle(self, request: Request, route: str, request_id: str, started: float) -> Response:
        self._authorize(request)
        raw = await self._read_body(request)
        body = _parse(raw, route)
        if self.models and body["model"] not in self.models:
            raise ProxyError(404, f"The model `{body['model']}` does not exist.", "model")
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        key = _affinity_key(body, route, self.config.routing.prefix_chars)
        # One watcher for everything before the response starts (prefill, decode's first chunk).
        return await _unless_disconnected(request, self._serve(route, raw, body, headers, key, started))

    async def _serve(
        self, route: str, raw: bytes, body: dict[str, Any], headers: dict[str, str], key: bytes, started: float
    ) -> Response:
        decode_body = raw
        if self.config.mode == "pd":
            params = await self._prefill(route, body, headers, key)
            if params is not None:
                decode_body = _with_params(raw, body, params)
        if body.get("stream"):
            return await self._decode_stream(route, decode_body, headers, key, started)
        return await self._decode(route, decode_body, headers, key, started)

    def _authorize(self, request: Request) -> None:
        if not self.keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or token not in self.keys:
            raise ProxyError(
                401, "Invalid or missing API key (Authorization: Bearer <key>).", None, "authentication_error"
            )

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ProxyError(413, f"Request body is larger than {limit} bytes.")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProxyError(413, f"Request body is larger than {limit} bytes.")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _prefill(self, route: str, body: dict[str, Any], headers: dict[str, str], key: bytes) -> Any:
        """kv_transfer_params from a prefill backend; None when decode must do it all (fallback)."""
        pbody = dict(body)
        pbody["max_tokens"] = 1
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        pbody["stream"] = False
        pbody.pop("stream_options", None)
        pbody["kv_transfer_params"] = {"do_remote_decode": True}
        payload = json.dumps(pbody).encode()

        async def attempt(backend: Backend) -> Any:
            async with self._post(backend, route, payload, headers, self._prefill_timeout) as resp:
                if resp.status >= 500:
                    raise _Retry(f"prefill {backend.url} answered {resp.status}")
                data = await resp.read()
                if resp.status >= 400:  # the client's request is wrong: say so, don't retry
                    raise _Passthrough(resp.status, data)
                try:
                    params = json.loads(data).get("kv_transfer_params")
                except (ValueError, AttributeError):
                    raise _Retry(f"prefill {backend.url} answered a non-JSON body") from None
                return params or {}

        try:
            return await self._with_retries(self.prefill, key, attempt)
        except _NoBackend:
            if self.config.fallback_to_decode:
                metrics.PD_FALLBACKS.inc()
                return None
            raise ProxyError(503, "No prefill backend is available.") from None

    async def _decode(
        self, route: str, payload: bytes, headers: dict[str, str], key: bytes, started: float
    ) -> Response:
        async def attempt(backend: Backend) -> Response:
            async with self._post(backend, route, payload, headers, self._decode_timeout) as resp:
                if resp.status >= 500:
                    raise _Retry(f"decode {backend.url} answered {resp.status}")
                data = await resp.read()
                metrics.TTFB.labels(route).observe(time.perf_counter() - started)
                return Response(data, resp.status, headers=_response_headers(resp, headers))

        try:
            return await self._with_retries(self.decode, key, attempt)
        except _NoBackend:
            raise ProxyError(503, "No decode backend is available.") from None

    async def _decode_stream(
        self, route: str, payload: bytes, headers: dict[str, str], key: bytes, started: float
    ) -> Response:
        """Commit to a backend only once its first chunk arrives: failures before that are retried."""

        async def attempt(backend: Backend) -> Response:
            ctx = self._post(backend, route, payload, headers, self._decode_timeout)
            resp = await ctx.__aenter__()
            try:
                if resp.status >= 500:
                    raise _Retry(f"decode {backend.url} answered {resp.status}")
                first = await resp.content.readany()
                if not first and resp.status == 200:
                    raise _Retry(f"decode {backend.url} closed the stream before any data")
            except BaseException:
                await ctx.__aexit__(None, None, None)
                raise
            metrics.TTFB.labels(route).observe(time.perf_counter() - started)
            ctx.hold()  # in flight until the stream ends
            return _Relay(
                self._relay(ctx, resp, first),
                status_code=resp.status,
                headers=_response_headers(resp, headers),
                media_type=resp.headers.get("Content-Type", "text/event-stream"),
            )

        try:
            return await self._with_retries(self.decode, key, attempt)
        except _NoBackend:
            raise ProxyError(503, "No decode backend is available.") from None

    async def _relay(self, ctx: _Upstream, resp: aiohttp.ClientResponse, first: bytes) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in resp.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            # Headers are sent: the only way to tell the client is an error event in the stream.
            ctx.failed = True
            logger.warning("decode %s failed mid-stream: %s", ctx.backend.url, exc)
            error = {
                "error": {
                    "message": f"The decode backend failed mid-stream: {type(exc).__name__}",
                    "type": "service_unavailable",
                    "param": None,
                    "code": 502,
                }
            }
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            # Also on client disconnect (the task is cancelled): closing aborts the upstream request.
            await ctx.release()

    async def _with_retries(self, pool: Pool, key: bytes, attempt: Any) -> Any:
        exclude: set[str] = set()
        for n in range(self.config.retries + 1):
            backend = pool.pick(key, frozenset(exclude))
            if backend is None:
                break
            if n:
                metrics.RETRIES.labels(pool.role).inc()
            try:
                result = await attempt(backend)
            except _Passthrough:
                pool.record_success(backend)
                raise
            except (TimeoutError, _Retry, aiohttp.ClientError) as exc:
                logger.warning("%s backend %s failed: %s", pool.role, backend.url, exc or type(exc).__name__)
                pool.record_failure(backend)
                exclude.add(backend.url)
                continue
            pool.record_success(backend)
            return result
        raise _NoBackend

    def _post(
        self, backend: Backend, route: str, payload: bytes, headers: dict[str, str], timeout: aiohttp.ClientTimeout
    ) -> _Upstream:
        assert self.session is not None
        return _Upstream(self.session, backend, route, payload, headers, timeout)


class _Relay(Response):
    """A streamed response relayed chunk by chunk, on the request's own task.

    Starlette's StreamingResponse runs two tasks per response (the stream and a disconnect
    listener); here one watcher cancels the relaying task when the client goes away, which also
    aborts the upstream request (the relay's ``finally`` closes it)."""

    def __init__(self, chunks: AsyncIterator[bytes], status_code: int, headers: dict[str, str], media_type: str):
        self.chunks = chunks
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        relaying = asyncio.current_task()
        assert relaying is not None
        watcher = asyncio.ensure_future(_disconnected_receive(receive))
        watcher.add_done_callback(lambda w: None if w.cancelled() else relaying.cancel())

        def client_gone() -> bool:
            return watcher.done() and not watcher.cancelled()

        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not client_gone():
                raise  # cancelled for another reason (shutdown): not ours to swallow
        finally:
            watcher.cancel()
            try:
                await self.chunks.aclose()
            except asyncio.CancelledError:
                # The client left just as the stream ended: its cancellation lands here instead.
                if not client_gone():
                    raise


class _Passthrough(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


class _NoBackend(Exception):
    pass


class _Upstream:
    """One upstream POST: counts the backend's in-flight requests from start to release."""

    def __init__(self, session, backend, route, payload, headers, timeout) -> None:  # type: ignore[no-untyped-def]
        self.backend = backend
        self.failed = False
        self._request = session.post(backend.url + route, data=payload, headers=headers, timeout=timeout)
        self._resp: aiohttp.ClientResponse | None = None
        self._held = False

    async def __aenter__(self) -> aiohttp.ClientResponse:
        self.backend.in_flight += 1
        metrics.IN_FLIGHT.labels(self.backend.url, self.backend.role).inc()
        try:
            self._resp = await self._request
        except BaseException:
            self._done()
            raise
        return self._resp

    async def __aexit__(self, *exc: object) -> None:
        if not self._held:
            await self.release()

    def hold(self) -> None:
        self._held = True

    async def release(self) -> None:
        if self._resp is not None:
            if self.failed or not self._resp.content.at_eof():
                self._resp.close()  # drop the connection: the backend stops working on it
            self._resp.release()
            self._resp = None
            self._done()

    def _done(self) -> None:
        self.backend.in_flight -= 1
        metrics.IN_FLIGHT.labels(self.backend.url, self.backend.role).dec()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, cancel it (closing the upstream requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ProxyError(499, "Client closed the request.")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    await _disconnected_receive(request.receive)


async def _disconnected_receive(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _parse(raw: bytes, route: str) -> dict[str, Any]:
    if not raw:
        raise ProxyError(400, "Request body is empty; expected a JSON object.")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProxyError(400, f"Request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "Request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProxyError(400, "'model' is required and must be a non-empty string.", "model")
    if route.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ProxyError(400, "'messages' is required and must be a non-empty list of objects.", "messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise ProxyError(
                400, "'prompt' is required: a string, or a non-empty list of strings or token ids.", "prompt"
            )
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ProxyError(400, "'stream' must be a boolean.", "stream")
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ProxyError(400, f"'{field}' must be a positive integer.", field)
    if "stream_options" in body and body["stream_options"] is not None and not isinstance(body["stream_options"], dict):
        raise ProxyError(400, "'stream_options' must be an object.", "stream_options")
    if "kv_transfer_params" in body and not isinstance(body["kv_transfer_params"], (dict, type(None))):
        raise ProxyError(400, "'kv_transfer_params' must be an object.", "kv_transfer_params")
    return body


def _with_params(raw: bytes, body: dict[str, Any], params: Any) -> bytes:
    """The client's body plus kv_transfer_params, spliced in without re-encoding the rest."""
    encoded = json.dumps(params).encode()
    stripped = raw.rstrip()
    if "kv_transfer_params" in body or not stripped.endswith(b"}") or len(body) == 0:
        return json.dumps({**body, "kv_transfer_params": params}).encode()
    return stripped[:-1] + b',"kv_transfer_params":' + encoded + b"}"


def _affinity_key(body: dict[str, Any], route: str, chars: int) -> bytes:
    if route.endswith("/chat/completions"):
        text = json.dumps(body.get("messages"), separators=(",", ":"))[:chars]
    else:
        prompt = body.get("prompt")
        text = prompt[:chars] if isinstance(prompt, str) else json.dumps(prompt)[:chars]
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _response_headers(resp: aiohttp.ClientResponse, sent: dict[str, str]) -> dict[str, str]:
    return {"X-Request-Id": resp.headers.get("X-Request-Id", sent["X-Request-Id"])}


class ProxyApp:
    """The ASGI app: the two hot routes go straight to the proxy, everything else to FastAPI.

    Skipping FastAPI's router and middleware stack on the hot path saves a layer of wrappers on
    every request and every streamed chunk (measured with benchmarks/proxy_overhead.py).
    """

    HOT_ROUTES = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, proxy: Proxy, api: FastAPI) -> None:
        self.proxy = proxy
        self.api = api

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in self.HOT_ROUTES and scope["method"] == "POST":
            request = Request(scope, receive, send)
            try:
                response = await self.proxy.handle(request, scope["path"])
            except Exception:
                logger.exception("unexpected error on %s", scope["path"])
                response = ProxyError(500, "Internal proxy error.", None, "internal_error").response()
            await response(scope, receive, send)
            return
        await self.api(scope, receive, send)


def create_app(config: ProxyConfig) -> ProxyApp:
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    api = FastAPI(title="UCM PD proxy", version="0.1.0", lifespan=lifespan)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        if not proxy.models:
            await proxy.check_health()
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "owned_by": "ucm"} for m in sorted(proxy.models)],
        }

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready() -> Response:
        if proxy.ready():
            return JSONResponse({"status": "ready"})
        return ProxyError(503, "Not ready: no healthy backend for a needed role.").response()

    @api.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return ProxyApp(proxy, api)
