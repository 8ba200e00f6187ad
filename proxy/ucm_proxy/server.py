"""The HTTP server around the app: uvicorn, with a deadline on each request's line and headers.

uvicorn bounds idle keep-alive connections but not a client that sends its headers a byte at a
time (or connects and sends nothing): each such connection is held for as long as the client
likes. ``timeouts.header_s`` starts when a connection opens or a request's first byte arrives and
ends when its headers are complete; a client that misses it gets 408 and the connection closes.
The body has its own deadline in the app (``timeouts.body_s``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ucm_proxy.config import ProxyConfig

_BODY = json.dumps({"error": {"message": "request headers not received in time", "type": "timeout", "code": 408}})
REQUEST_TIMEOUT = (
    "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    f"content-length: {len(_BODY)}\r\n\r\n{_BODY}"
).encode()


def header_deadline_protocol(header_s: float) -> type[HttpToolsProtocol]:
    class HeaderDeadline(HttpToolsProtocol):
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
            super().on_headers_complete()

    return HeaderDeadline


def uvicorn_config(app: Any, config: ProxyConfig, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=False,
        proxy_headers=False,  # nothing reads the client's address: no middleware layer per request
        loop="uvloop",
        http=header_deadline_protocol(config.timeouts.header_s),
    )
