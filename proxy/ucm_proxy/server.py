"""The HTTP server around the app: uvicorn, with the hot routes served without ASGI, and limits on
what a request's head may cost before the app sees it.

uvicorn runs the sockets, keep-alive, pipelining, lifespan and shutdown. Its HTTP protocol is
subclassed here: a ``POST`` to one of ``ProxyApp.HOT_ROUTES`` becomes an ``Exchange`` that the
proxy answers on the socket (``exchange``); every other request goes through ASGI to FastAPI.

uvicorn bounds neither how long nor how large a request's head may grow. Held open, a connection
costs a socket; grown, it costs CPU: httptools copies a header's value whole each time more of it
arrives (and uvicorn the URL), so a header trickled a piece at a time costs the square of its
length, on the event loop every request shares. So, before the app:

- ``timeouts.header_s`` starts when a connection opens or a request's first byte arrives and ends
  when its headers are complete; a client that misses it gets 408.
- ``max_header_bytes`` bounds a head's bytes, counted as they arrive, before the parser sees them;
  a chunked body's trailers (parsed like headers, at the same cost) get the same room.
  ``max_header_count`` bounds its header lines (trailers included). Past either: 431.

Each refusal closes the connection and is counted in ``ucm_proxy_rejected_requests_total``. The
body has its own deadline and budget in the app (``timeouts.body_s``, ``max_in_flight_bytes``,
and each client's share of it, keyed by ``client_key``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import urllib.parse

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ucm_proxy import metrics
from ucm_proxy.app import ProxyApp
from ucm_proxy.errors import error_body
from ucm_proxy.exchange import Exchange


class HeadRefused(Exception):
    """Raised in a parser callback, once the head is answered, to stop parsing the connection."""


def client_key(host: str | None) -> str:
    """Whom a connection's requests count against: its IPv4 address, or its IPv6 /64 (what one host
    is usually given: by address, one host could be 2^64 clients)."""
    if host is None:
        return ""  # not an IP socket: all such connections are one client
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return host


def refusal(status: int, message: str, kind: str | None = None) -> bytes:
    """A whole answer to a request the app never sees, closing its connection."""
    body = json.dumps(error_body(status, message, kind), separators=(",", ":")).encode()
    framing = b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
    return STATUS_LINE[status] + framing + body


def proxy_protocol(app: ProxyApp) -> type[HttpToolsProtocol]:
    config = app.proxy.config
    hot_routes = frozenset(app.HOT_ROUTES)
    header_s, max_header_bytes, max_header_count = (
        config.timeouts.header_s,
        config.max_header_bytes,
        config.max_header_count,
    )
    request_timeout = refusal(408, "request headers not received in time", "timeout")
    head_too_large = refusal(431, f"Request line and headers (or trailers) are larger than {max_header_bytes} bytes.")
    too_many_headers = refusal(431, f"More than {max_header_count} request headers (or trailers).")

    class ProxyProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        # Bytes the head being read (or a chunked body's trailers) may still take; None while a
        # body is read. The first bytes of a head that starts inside a read (pipelined behind a
        # body, or trailers behind their last chunk) are not counted: at most one read more.
        _head_room: int | None = max_header_bytes
        _client = ""  # client_key of the peer

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            self._refuse(request_timeout, "header_timeout")

        def _refuse(self, answer: bytes, reason: str) -> None:
            self._disarm()
            self._head_room = None
            if not self.transport.is_closing():
                metrics.child(metrics.REJECTED, reason).inc()
                self.transport.write(answer)
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._client = client_key(self.client[0] if self.client else None)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            while True:
                room = self._head_room
                if room is None or len(data) <= room:
                    if room is not None:
                        self._head_room = room - len(data)
                    self._parse(data)
                    return
                # More than the head may still take: parse only that much. Its headers complete
                # within it, the rest is a body or a next request (and counted as such); else the
                # head is too large, and refused before the parser copies any more of it.
                self._head_room = 0
                if room:
                    self._parse(data[:room])
                if self.transport.is_closing() or self.transport.get_protocol() is not self:
                    return  # answered (refused, malformed) or handed to a WebSocket protocol
                if self._head_room == 0:
                    self._refuse(head_too_large, "header_bytes")
                    return
                data = data[room:]

        def _parse(self, data: bytes) -> None:
            """uvicorn's ``data_received``, except that a head refused in a parser callback (which
            raises to stop the parser) is already answered: not a 400."""
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
            except httptools.HttpParserError:
                if not self.transport.is_closing():
                    self.logger.warning("Invalid HTTP request received.")
                    self.send_400_response("Invalid HTTP request received.")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # the next request on a kept-alive connection

        def on_header(self, name: bytes, value: bytes) -> None:
            if len(self.headers) >= max_header_count:
                self._refuse(too_many_headers, "header_count")
                raise HeadRefused
            super().on_header(name, value)

        def on_chunk_header(self) -> None:
            # A chunk's size line: its data follows, or, after the last (empty) chunk, trailers,
            # which httptools copies as it does headers.
            self._head_room = max_header_bytes

        def on_body(self, body: bytes) -> None:
            self._head_room = None
            super().on_body(body)

        def on_chunk_complete(self) -> None:
            self._head_room = None

        def on_message_complete(self) -> None:
            self._head_room = max_header_bytes  # what follows is the next request's head
            super().on_message_complete()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._head_room = None
            route = self._hot_route()
            if route is None:
                super().on_headers_complete()
                return
            http_version = self.parser.get_http_version()
            exchange = Exchange(
                route,
                self.headers,
                app.serve,
                self.transport,
                self.flow,
                self.server_state.default_headers,
                keep_alive=http_version != "1.0" and self.parser.should_keep_alive(),
                expect_100_continue=self.expect_100_continue,
                on_response=self.on_response_complete,
                client=self._client,
            )
            # As uvicorn does with its own cycles: a request pipelined behind one still being
            # answered waits (reading paused) until that answer is complete.
            previous, self.cycle = self.cycle, exchange  # type: ignore[assignment]
            if previous is None or previous.response_complete:
                self._start_asgi_task(exchange, self.app)  # type: ignore[arg-type]
            else:
                self.flow.pause_reading()
                self.pipeline.appendleft((exchange, self.app))  # type: ignore[arg-type]

        def _hot_route(self) -> str | None:
            if self.parser.get_method() != b"POST" or self.parser.should_upgrade():
                return None
            path = httptools.parse_url(self.url).path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
            return path if path in hot_routes else None

    return ProxyProtocol


def uvicorn_config(app: ProxyApp, log_level: str) -> uvicorn.Config:
    config = app.proxy.config
    return uvicorn.Config(
        app.api,
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=False,
        # A client is its peer address (client_key), never a header it could write; and no middleware
        # layer per request.
        proxy_headers=False,
        loop="uvloop",
        http=proxy_protocol(app),
    )
