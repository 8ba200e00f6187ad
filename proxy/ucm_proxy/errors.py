"""OpenAI-style error bodies, and the exceptions the request path uses to choose between them."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from ucm_proxy.answers import Answer


def error_body(status: int, message: str, kind: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The error object OpenAI clients parse (``{"error": {message, type, param, code}}``)."""
    kind = kind or ("invalid_request_error" if status < 500 else "service_unavailable")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def sse_error(status: int, message: str) -> bytes:
    """The error as the last events of a stream whose headers are already sent."""
    return f"data: {json.dumps(error_body(status, message))}\n\ndata: [DONE]\n\n".encode()


class ProxyError(Exception):
    """An error answered to the client as an OpenAI-style error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def answer(self, request_id: str | None = None) -> Answer:
        headers = {**self.headers, **({"X-Request-Id": request_id} if request_id else {})}
        body = json.dumps(error_body(self.status, self.message, self.kind, self.param), separators=(",", ":")).encode()
        return Answer(self.status, body, headers)

    def response(self) -> Response:
        """The same answer from a FastAPI route."""
        answer = self.answer()
        return Response(answer.body, answer.status, answer.headers, media_type=answer.content_type)


class Retry(Exception):
    """This backend failed before answering; try another."""


class Passthrough(Exception):
    """A backend's 4xx about the client's request: answered as it was, never retried."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


class NoBackend(Exception):
    """Every backend of the pool was tried (or none is available)."""
