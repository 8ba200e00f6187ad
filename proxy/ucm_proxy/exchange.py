"""One client request on the hot path, read from and answered on the socket without ASGI.

uvicorn's HTTP protocol drives each request through an object it calls a *cycle*: it appends body
bytes to ``cycle.body`` and clears ``cycle.more_body`` at the end of the message (setting
``cycle.message_event`` for either), sets ``cycle.disconnected`` when the client goes away, reads
``cycle.response_complete`` and ``cycle.keep_alive`` (shutdown clears the latter), and runs
``cycle.run_asgi(app)`` as the request's task — at once, or after the requests pipelined before it
on the connection. An ``Exchange`` is such a cycle for the two hot routes (``server`` makes one
instead of uvicorn's ``RequestResponseCycle``), so uvicorn keeps doing what it does well —
sockets, keep-alive, pipelining, timeouts, graceful shutdown — while the proxy's requests skip
the ASGI layer: no scope, message dicts or Starlette objects per request and chunk, no watcher
task per request (the client leaving cancels the request's task directly), and a stream's
headers go out in the same write as its first chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from ucm_proxy.answers import Answer
from ucm_proxy.errors import ProxyError
from ucm_proxy.relay import Stream

logger = logging.getLogger("ucm_proxy")
T = TypeVar("T")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Exchange:
    """A hot-route request: its headers and body as uvicorn parses them, and its answer."""

    __slots__ = (
        "_disconnected",
        "body",
        "client",
        "default_headers",
        "expect_100_continue",
        "flow",
        "guarding",
        "headers",
        "keep_alive",
        "message_event",
        "more_body",
        "on_body",
        "on_response",
        "response_complete",
        "route",
        "serve",
        "task",
        "transport",
    )

    def __init__(
        self,
        route: str,
        headers: list[tuple[bytes, bytes]],
        serve: Callable[[Exchange], Awaitable[None]],
        transport: asyncio.Transport,
        flow: FlowControl,
        default_headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        expect_100_continue: bool,
        on_response: Callable[[], None],
        client: str,
    ) -> None:
        self.route = route
        self.headers = headers  # names lowercased by uvicorn
        self.serve = serve  # the coroutine function that answers it (ProxyApp.serve)
        self.transport = transport
        self.flow = flow
        self.default_headers = default_headers  # uvicorn's server and date headers
        self.keep_alive = keep_alive
        self.expect_100_continue = expect_100_continue
        self.on_response = on_response  # uvicorn's: starts the next pipelined request, or the keep-alive timer
        self.client = client  # whose share of the body budget it takes (server.client_key)
        self.message_event = asyncio.Event()
        self.body = bytearray()
        self.more_body = True
        # Told the body's size so far as it arrives (ProxyApp holds that much of the budget); may
        # raise to refuse the rest.
        self.on_body: Callable[[int], None] | None = None
        self.response_complete = False
        self._disconnected = False
        self.guarding = False  # while True, the client leaving cancels the request's task
        self.task: asyncio.Task[None] | None = None

    # -- what uvicorn's protocol calls -----------------------------------------------------------
    @property
    def disconnected(self) -> bool:
        """Whether the client went away before its answer was complete."""
        return self._disconnected

    @disconnected.setter
    def disconnected(self, value: bool) -> None:
        self._disconnected = value
        if value and self.guarding and self.task is not None:
            self.task.cancel()  # closes the request's upstream requests as it unwinds

    async def run_asgi(self, app: object) -> None:
        """The request's task (uvicorn's name for it; ``app``, the ASGI app, is not used)."""
        self.task = asyncio.current_task()
        try:
            await self.serve(self)
        except Exception:  # the request path answers its own errors: this is a bug, not a client's fault
            logger.exception("unexpected error answering %s", self.route)
        finally:
            self.guarding = False
            self.on_response = _nothing  # a late completion must not start the next request twice
            if not self.response_complete and not self._disconnected:
                self.transport.close()  # the client must not wait for the rest of a broken answer

    # -- the request -----------------------------------------------------------------------------
    def header(self, name: bytes) -> str | None:
        """A request header's value (``name`` lowercase); the first if it was sent twice."""
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return None

    def declared_length(self) -> int | None:
        """The body's Content-Length; None when it is chunked."""
        length = self.header(b"content-length")
        return int(length) if length is not None and length.isdigit() else None

    async def read_body(self, limit: int) -> bytes:
        """The whole body; 413 once it passes ``limit`` bytes (at once when its Content-Length
        says so: nothing is read), 499 if the client leaves first."""
        declared = self.declared_length()
        if declared is not None and declared > limit:
            raise _too_large(limit)
        if self.expect_100_continue:
            self.expect_100_continue = False
            self.transport.write(CONTINUE)
        while self.more_body and not self._disconnected:
            if len(self.body) > limit:
                break
            if self.on_body is not None:
                self.on_body(len(self.body))
            self.flow.resume_reading()  # uvicorn pauses reading past 64 KiB of unread body
            await self.message_event.wait()
            self.message_event.clear()
        if len(self.body) > limit:
            raise _too_large(limit)
        if self.on_body is not None:
            self.on_body(len(self.body))
        if self._disconnected:
            raise _client_left()
        body, self.body = bytes(self.body), bytearray()
        return body

    async def unless_client_leaves(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` on this task, watching the client from now to the answer's last byte: if it
        leaves before ``work`` is done, ``work`` is cancelled (closing its upstream requests) and
        the answer is 499."""
        if self._disconnected:
            work.close()
            raise _client_left()
        self.guarding = True
        try:
            return await work
        except asyncio.CancelledError:
            if self._cancelled_by_client():
                raise _client_left() from None
            raise

    def _cancelled_by_client(self) -> bool:
        """After a CancelledError on this task: whether the client leaving, and nothing else,
        cancelled it (that cancellation is then spent)."""
        task = asyncio.current_task()
        return self._disconnected and task is not None and task.uncancel() == 0

    # -- the answer ------------------------------------------------------------------------------
    async def send(self, response: Answer | Stream) -> None:
        if self.more_body:
            # Answered before the whole body arrived (401, 413, 429, 408): the rest is never read.
            # Kept alive, the connection would take it in and drop it for as long as the client
            # trickled it, then parse what followed as a next request: close it after the answer.
            self.keep_alive = False
        if isinstance(response, Answer):
            self.guarding = False  # a whole answer goes out now: too late to cancel anything
            length = b"content-length: %d\r\n" % len(response.body)
            head = self._head(response.status, response.headers, response.content_type, length)
            await self._write(head + response.body, True)
            return
        try:
            await self._relay(response)
        except asyncio.CancelledError:
            if not self._cancelled_by_client():
                raise  # cancelled for another reason (shutdown): not ours to swallow
        finally:
            self.guarding = False
            await response.close()

    async def _relay(self, stream: Stream) -> None:
        """Chunked transfer: the headers with the first chunk, the terminator with the last."""
        head = self._head(stream.status, stream.headers, stream.content_type, b"transfer-encoding: chunked\r\n")
        async for chunk, last in stream.chunks:
            data = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunk else b""
            if last:
                await self._write(head + data + b"0\r\n\r\n", True)
                return
            if data:
                await self._write(head + data, False)
                head = b""
        await self._write(head + b"0\r\n\r\n", True)

    def _head(self, status: int, headers: dict[str, str], content_type: str, framing: bytes) -> bytes:
        # Every value here comes from our own code or from a header a parser already accepted
        # (llhttp refuses line breaks in values), so none can split the response.
        parts = [STATUS_LINE[status]]
        for name, value in self.default_headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(f"content-type: {content_type}\r\n".encode("latin-1"))
        for name, text in headers.items():
            parts.append(f"{name}: {text}\r\n".encode("latin-1"))
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (framing, b"\r\n")
        return b"".join(parts)

    async def _write(self, data: bytes, last: bool) -> None:
        if self.flow.write_paused and not self._disconnected:
            await self.flow.drain()  # a slow client: stop reading upstream until it catches up
        if self._disconnected or self.transport.is_closing():
            return
        self.transport.write(data)
        if last:
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()


def _too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"Request body is larger than {limit} bytes.")


def _client_left() -> ProxyError:
    return ProxyError(499, "Client closed the request.")


def _nothing() -> None:
    pass
