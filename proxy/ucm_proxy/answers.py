"""What the hot path answers a client: a whole response, or a stream relayed from a backend."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm_proxy.relay import Upstream


class Answer:
    """A whole response, written in one piece."""

    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(self, status: int, body: bytes, headers: dict[str, str], content_type: str = "application/json"):
        self.status, self.body, self.headers, self.content_type = status, body, headers, content_type


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
