"""An engine whose store stays stuck says so on ``/health``, so the proxy and Kubernetes act.

The connector's scheduler half runs in vLLM's engine process; ``/health`` is answered by the API
server process. They share one small file (``UCM_STORE_HEALTH_FILE``, which ``ucm serve`` sets to a
fresh path per start): the scheduler writes it when a store call misses its deadline and removes
it when that call finally returns; ``StoreHealthMiddleware`` (added with vLLM's ``--middleware``)
answers ``/health`` with 503 once the call has been stuck for ``store_unhealthy_after_s``.

Until then the engine keeps serving: lookups count as misses and blocks are recomputed. A short
stall should not take every engine sharing the store out of service at once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HEALTH_FILE_ENV = "UCM_STORE_HEALTH_FILE"
MIDDLEWARE = f"{__name__}.StoreHealthMiddleware"


class StoreHealth:
    """The scheduler's side: records when the store stopped answering (wall time, shared with the
    API server process) and when it answers again. Without the environment variable it does
    nothing: the engine was not started by ``ucm serve`` and nobody reads the file."""

    def __init__(self, unhealthy_after_s: float | None, environ: dict[str, str] | None = None) -> None:
        path = (os.environ if environ is None else environ).get(HEALTH_FILE_ENV)
        self.path = Path(path) if path and unhealthy_after_s is not None else None
        self.unhealthy_after_s = unhealthy_after_s

    def stuck(self, since: float) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"since": since, "unhealthy_after_s": self.unhealthy_after_s}))
            tmp.replace(self.path)
        except OSError as exc:
            logger.warning("cannot record the store's state in %s: %s", self.path, exc)

    def answered(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def stuck_for(path: Path, now: float | None = None) -> tuple[float, float] | None:
    """(seconds stuck, threshold) when the file says the store is stuck past its threshold."""
    try:
        state = json.loads(path.read_text())
        since, threshold = float(state["since"]), float(state["unhealthy_after_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent (healthy) or being replaced: the next probe reads it again
    stuck = (time.time() if now is None else now) - since
    return (stuck, threshold) if stuck >= threshold else None


class StoreHealthMiddleware:
    """Pure ASGI middleware for vLLM's API server: ``GET /health`` is 503 while the store is stuck
    past its threshold; everything else passes through."""

    def __init__(self, app: Any) -> None:
        self.app = app
        path = os.environ.get(HEALTH_FILE_ENV)
        self.path = Path(path) if path else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.path is not None and scope["type"] == "http" and scope["path"] == "/health":
            stuck = stuck_for(self.path)
            if stuck is not None:
                body = json.dumps(
                    {"error": f"the KV store has not answered for {stuck[0]:.0f} s (limit {stuck[1]:g} s)"}
                ).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
