"""Upstream requests and relaying their streams: in-flight accounting per backend, and a stream's
chunks passed on as they arrive (an SSE error event if the backend fails mid-stream), as the
streamed response the hot path answers a client with."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator

from ucm_proxy import http1
from ucm_proxy.backends import Backend
from ucm_proxy.errors import sse_error
from ucm_proxy.http1 import Client, UpstreamError

logger = logging.getLogger("ucm_proxy")


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


async def relay_chunks(
    upstream: Upstream, resp: http1.Response, first: bytes
) -> AsyncGenerator[tuple[bytes, bool], None]:
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


class Stream:
    """A streamed response: the chunks of the upstream request it relays, as they arrive."""

    __slots__ = ("chunks", "content_type", "headers", "status", "upstream")

    def __init__(
        self,
        upstream: Upstream,
        chunks: AsyncGenerator[tuple[bytes, bool], None],
        status: int,
        headers: dict[str, str],
        content_type: str,
    ):
        self.upstream, self.chunks = upstream, chunks
        self.status, self.headers, self.content_type = status, headers, content_type

    async def close(self) -> None:
        """Once relayed, or abandoned: a stream never started never ran its own cleanup."""
        try:
            await self.chunks.aclose()
        finally:
            self.upstream.release()  # idempotent
