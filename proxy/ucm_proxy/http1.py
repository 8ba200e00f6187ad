"""A lean HTTP/1.1 client for the proxy's hot path: POSTs to the engines on kept-alive connections.

aiohttp's client was ~40% of the proxy's CPU per streamed request (py-spy under wrk, with
benchmarks/proxy_overhead.py): a request, a response, a payload, a stream reader, timers and trace
hooks per call, headers and body written apart. Here a request is one write, the response is parsed
by httptools (llhttp, as uvicorn parses requests), and body bytes are handed over as they arrive,
everything that arrived since the last read in one piece. Health checks, the engines' metrics and the
Kubernetes API stay on aiohttp: they are off the hot path and use more of HTTP.

Timeouts: ``connect_s`` bounds opening a connection; ``idle_s`` (streams) bounds each silence of
the backend while the proxy waits for it, checked by one timer per idle window rather than one per
chunk. Whole-request deadlines are the caller's (``asyncio.timeout``).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import urlsplit

import httptools

# Past this many unread bytes the connection stops reading: a slow client holds the backend back
# (TCP flow control) instead of the proxy buffering a whole answer.
HIGH_WATER = 256 * 1024
# A connection idle for longer is closed rather than reused: a middlebox may have dropped it silently,
# and a request sent on it would wait for its timeout. (vLLM's server closes its own after 5 s.)
MAX_IDLE_S = 30.0


class UpstreamError(Exception):
    """The backend could not be reached, or broke the HTTP exchange."""


class TooLarge(Exception):
    """A whole body read with a limit went past it."""


class Response:
    """A response's status and headers; its body is read with ``read`` or ``chunk``."""

    __slots__ = ("_chunks", "_conn", "_ended", "_error", "_size", "_waiter", "headers", "status")

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}  # names in lower case
        self._conn: _Connection | None = conn
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    async def chunk(self) -> bytes:
        """Whatever body arrived since the last call (waiting for some); b"" once the body is over."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._ended:
                return b""
            await self._wait()
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        if self._conn is not None:
            self._conn.drained()
        return data

    async def read(self, limit: int) -> bytes:
        """The whole body; :class:`TooLarge` once more than ``limit`` bytes arrived (the proxy holds
        what it reads whole, so a backend cannot make it hold more)."""
        parts, size = [], 0
        while data := await self.chunk():
            size += len(data)
            if size > limit:
                raise TooLarge(limit)
            parts.append(data)
        return b"".join(parts)

    def at_eof(self) -> bool:
        return self._ended and not self._chunks

    def release(self) -> None:
        """Done with it: a connection whose answer arrived whole is kept for the next request;
        otherwise it is closed, which also stops the backend working on an abandoned request."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish()

    # -- fed by the connection -------------------------------------------------------------------
    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        self._wake()

    def _end(self) -> None:
        self._ended = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._ended and self._error is None:
            self._error = error
            self._wake()


class _Connection(asyncio.Protocol):
    """One TCP connection to a backend, carrying one request at a time."""

    def __init__(self, pool: list[_Connection], loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.headers_ready: asyncio.Future[None] | None = None
        self.received = False  # any byte of the current response
        self.idle_since = 0.0
        self.keep_alive = False
        self.paused = False
        self.idle_s: float | None = None
        self.last_data = 0.0
        self.idle_timer: asyncio.TimerHandle | None = None

    # -- the request -----------------------------------------------------------------------------
    def send(self, request: bytes, idle_s: float | None) -> Response:
        assert self.transport is not None
        self.response = Response(self)
        self.headers_ready = self.loop.create_future()
        self.received = self.keep_alive = False
        self.idle_s = idle_s
        if idle_s is not None:
            self.last_data = self.loop.time()
            self.idle_timer = self.loop.call_later(idle_s, self._check_idle)
        self.transport.write(request)
        return self.response

    def finish(self) -> None:
        self._stop_idle_timer()
        self.response = self.headers_ready = None
        if self.keep_alive and self.transport is not None and not self.transport.is_closing():
            self.drained()  # an answer left unread may have paused reading
            self.idle_since = self.loop.time()
            self.pool.append(self)
        elif self.transport is not None:
            self.transport.close()

    def drained(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _check_idle(self) -> None:
        self.idle_timer = None
        assert self.idle_s is not None
        silent = self.loop.time() - self.last_data
        if self.paused:  # the client is slow, not the backend
            silent = 0.0
        if silent < self.idle_s:
            self.idle_timer = self.loop.call_later(self.idle_s - silent, self._check_idle)
            return
        self._fail(TimeoutError(f"no data from the backend for {self.idle_s} s"))
        if self.transport is not None:
            self.transport.close()

    def _stop_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def _fail(self, error: BaseException) -> None:
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_exception(error)
        if self.response is not None:
            self.response._fail(error)

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            # Bytes nobody asked for: the connection's state is unknown, so it is not reused.
            assert self.transport is not None
            self.transport.close()
            return
        self.received = True
        if self.idle_s is not None:
            self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed response: {exc}"))
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        self._stop_idle_timer()
        self.transport = None
        response = self.response
        if response is None:
            return
        if self._delimited_by_close():
            response._end()
        else:
            why = f": {exc}" if exc else ""
            self._fail(UpstreamError(f"the backend closed the connection{why}"))

    def _delimited_by_close(self) -> bool:
        """A response with neither a length nor chunks ends where the connection does."""
        assert self.response is not None
        headers = self.response.headers
        return (
            self.response.status != 0  # its headers are in
            and "content-length" not in headers
            and "chunked" not in headers.get("transfer-encoding", "")
        )

    # -- httptools callbacks ---------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self.response is not None and self.headers_ready is not None
        self.response.status = self.parser.get_status_code()
        if not self.headers_ready.done():
            self.headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)
        if self.response._size > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        assert self.response is not None
        self.keep_alive = self.parser.should_keep_alive()
        self._stop_idle_timer()
        self.response._end()


class Client:
    """POSTs to backends by base URL (``http://host:port[/prefix]``), reusing idle connections."""

    def __init__(self, headers: dict[str, str] | None = None) -> None:
        headers = headers or {}
        if any("\r" in text or "\n" in text for item in headers.items() for text in item):
            raise ValueError("a header name or value holds a line break")
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._targets: dict[str, _Target] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post(
        self, url: str, path: str, body: bytes, headers: dict[str, str], connect_s: float, idle_s: float | None = None
    ) -> Response:
        """Sends the request and returns once the response's headers are in."""
        target = self._targets.get(url) or self._target(url)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = (
            f"POST {target.prefix}{path} HTTP/1.1\r\nHost: {target.host_header}\r\n"
            f"Content-Length: {len(body)}\r\n{self._headers}{extra}\r\n"
        ).encode("latin-1") + body
        now = asyncio.get_running_loop().time()
        while target.idle:
            conn = target.idle.pop()
            if conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > MAX_IDLE_S:
                conn.transport.close()
                continue
            response = conn.send(request, idle_s)
            try:
                return await self._headers_of(conn, response)
            except UpstreamError:
                # A kept-alive connection the backend closed just as it was reused: nothing was
                # processed, so the request goes out again on a new connection.
                if conn.received:
                    raise
        conn = await self._connect(target, connect_s)
        return await self._headers_of(conn, conn.send(request, idle_s))

    async def _headers_of(self, conn: _Connection, response: Response) -> Response:
        assert conn.headers_ready is not None
        try:
            await conn.headers_ready
        except BaseException:
            response.release()
            raise
        return response

    async def _connect(self, target: _Target, connect_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if target.tls:
            context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(target.idle, loop), target.host, target.port, ssl=context
                )
        except TimeoutError:
            raise UpstreamError(f"connecting to {target.host}:{target.port} took over {connect_s} s") from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {target.host}:{target.port}: {exc}") from None
        return conn

    def _target(self, url: str) -> _Target:
        self._targets[url] = target = _Target(url)
        return target

    def close(self) -> None:
        for target in self._targets.values():
            for conn in list(target.idle):
                if conn.transport is not None:
                    conn.transport.close()
            target.idle.clear()


class _Target:
    __slots__ = ("host", "host_header", "idle", "port", "prefix", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.host_header = parts.netloc.rsplit("@", 1)[-1]
        self.prefix = parts.path.rstrip("/")
        self.idle: list[_Connection] = []
