"""The HTTP server around the app: uvicorn, with the hot routes served without ASGI and a
deadline on each request's line and headers.

uvicorn runs the sockets, keep-alive, pipelining, lifespan and shutdown. Its HTTP protocol is
subclassed here: a ``POST`` to one of ``ProxyApp.HOT_ROUTES`` becomes an ``Exchange`` that the
proxy answers on the socket (``exchange``); every other request goes through ASGI to FastAPI.

uvicorn bounds idle keep-alive connections but not a client that sends its headers a byte at a
time (or connects and sends nothing): each such connection is held for as long as the client
likes. ``timeouts.header_s`` starts when a connection opens or a request's first byte arrives and
ends when its headers are complete; a client that misses it gets 408 and the connection closes.
The body has its own deadline in the app (``timeouts.body_s``).
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ucm_proxy.app import ProxyApp
from ucm_proxy.exchange import Exchange

_BODY = json.dumps({"error": {"message": "request headers not received in time", "type": "timeout", "code": 408}})
REQUEST_TIMEOUT = (
    "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    f"content-length: {len(_BODY)}\r\n\r\n{_BODY}"
).encode()


def proxy_protocol(app: ProxyApp, header_s: float) -> type[HttpToolsProtocol]:
    hot_routes = frozenset(app.HOT_ROUTES)

    class ProxyProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.write(REQUEST_TIMEOUT)
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # the next request on a kept-alive connection

        def on_headers_complete(self) -> None:
            self._disarm()
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
        proxy_headers=False,  # nothing reads the client's address: no middleware layer per request
        loop="uvloop",
        http=proxy_protocol(app, config.timeouts.header_s),
    )
