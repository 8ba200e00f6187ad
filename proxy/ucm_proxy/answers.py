"""A whole response, as the hot path answers a client (a stream relayed from a backend: ``ucm_proxy.relay.Stream``)."""

from __future__ import annotations


class Answer:
    """A whole response, written in one piece."""

    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(self, status: int, body: bytes, headers: dict[str, str], content_type: str = "application/json"):
        self.status, self.body, self.headers, self.content_type = status, body, headers, content_type
