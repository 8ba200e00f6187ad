"""Upstream requests and relaying their responses: in-flight accounting per backend, streams
relayed chunk by chunk on the request's own task, and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.responses import Response

from ucm_proxy import http1
from ucm_proxy.backends import Backend
from ucm_proxy.errors import ProxyError, sse_error
from ucm_proxy.http1 import Client, UpstreamError

logger = logging.getLogger("ucm_proxy")
T = TypeVar("T")


class Upstream:
    """One upstream POST: counts the backend's in-flight requests from start to release."""

    def __init__(
        self,
        client: Client,
        backend: Backend,
        route: str,
        payload: bytes,
        headers: dict[str, str],
        connect_s: float,
        idle_s: float | None,
    ) -> None:
        self.backend = backend
        self._call = (client, route, payload, headers, connect_s, idle_s)
        self._resp: http1.Response | None = None
        self._held = False

    async def __aenter__(self) -> http1.Response:
        self.backend.in_flight += 1
        self.backend.in_flight_gauge.inc()
        client, route, payload, headers, connect_s, idle_s = self._call
        try:
            self._resp = await client.post(self.backend.url, route, payload, headers, connect_s, idle_s)
        except BaseException:
            self._done()
            raise
        return self._resp

    async def __aexit__(self, *exc: object) -> None:
        if not self._held:
            self.release()

    def hold(self) -> None:
        """Keep the request open past the ``async with``: a stream being relayed releases it."""
        self._held = True

    def release(self) -> None:
        """A response not read to its end closes its connection: the backend stops working on it."""
        if self._resp is not None:
            self._resp.release()
            self._resp = None
            self._done()

    def _done(self) -> None:
        self.backend.in_flight -= 1
        self.backend.in_flight_gauge.dec()


async def relay_chunks(upstream: Upstream, resp: http1.Response, first: bytes) -> AsyncIterator[tuple[bytes, bool]]:
    """The stream's chunks as they arrive, each with whether the stream ended with it (then the
    client's terminating chunk goes out in the same write); an SSE error event if the backend fails
    mid-stream."""
    try:
        yield first, resp.at_eof()
        while chunk := await resp.chunk():
            yield chunk, resp.at_eof()
    except (TimeoutError, UpstreamError) as exc:
        # Headers are sent: the only way to tell the client is an error event in the stream.
        logger.warning("decode %s failed mid-stream: %s", upstream.backend.url, exc)
        yield sse_error(502, f"The decode backend failed mid-stream: {type(exc).__name__}"), True
    finally:
        # Also on client disconnect (the task is cancelled): closing aborts the upstream request.
        upstream.release()


class ClientWatch:
    """Watches a request's client from the end of its body to the last byte of its answer: if the
    client goes away meanwhile, the request's task is cancelled, which closes its upstream requests.

    One watcher task per request serves both phases (before the answer starts, and a stream being
    relayed on the same task), where Starlette's StreamingResponse runs two tasks per stream."""

    __slots__ = ("_task", "_watcher", "gone", "guarding")

    def __init__(self, receive: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self.gone = False
        self.guarding = True  # off once a whole answer is being sent: too late to cancel anything
        self._watcher = asyncio.ensure_future(disconnected(receive))
        self._watcher.add_done_callback(self._client_left)

    def _client_left(self, watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled():
            return
        self.gone = True
        if self.guarding:
            self._task.cancel()

    def close(self) -> None:
        self.guarding = False
        self._watcher.cancel()


# Where a request's ClientWatch travels from the handler to the response it returns.
WATCH = "ucm_proxy.watch"


def stop_watching(scope: dict[str, Any]) -> None:
    watch = scope.pop(WATCH, None)
    if watch is not None:
        watch.close()


class Relay(Response):
    """A streamed response relayed chunk by chunk, on the request's own task: when the client goes
    away, the request's ClientWatch cancels it, which also aborts the upstream request
    (``relay_chunks`` closes it)."""

    def __init__(
        self,
        upstream: Upstream,
        chunks: AsyncIterator[tuple[bytes, bool]],
        status_code: int,
        headers: dict[str, str],
        media_type: str,
    ):
        self.upstream, self.chunks = upstream, chunks
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watch: ClientWatch = scope[WATCH]  # stopped by the app once this returns
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            ended = False
            async for chunk, last in self.chunks:
                ended = last
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    break
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.gone:
                raise  # cancelled for another reason (shutdown): not ours to swallow
        finally:
            watch.guarding = False
            try:
                await self.chunks.aclose()  # type: ignore[attr-defined]
                # A stream never started never ran its own cleanup: release here (idempotent).
                self.upstream.release()
            except asyncio.CancelledError:
                # The client left just as the stream ended: its cancellation lands here instead.
                if not watch.gone:
                    raise


async def unless_disconnected(watch: ClientWatch, work: Awaitable[T]) -> T:
    """Await ``work`` on this task; if the client goes away first, ``watch`` cancels it (closing the
    upstream requests) and the answer is 499."""
    try:
        return await work
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if watch.gone and current is not None and current.uncancel() == 0:
            raise ProxyError(499, "Client closed the request.") from None
        raise


async def disconnected(receive: Any) -> None:
    """Returns when the ASGI server reports that the client went away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
