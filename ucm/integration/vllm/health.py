"""``/health`` of an engine started by ``ucm serve``: not ready until it is warm, and saying when its
store stays stuck, so the proxy and Kubernetes act on both.

**Warm-up.** vLLM's first request after a start that asks for logprobs is slow (on the CPU build,
2.8-3.6 s against 0.03-0.06 s for the next ones: set up on first use), and it would be a user's
request — after every restart, scale-up and rollout. With ``UCM_ENGINE_WARMUP=1`` (set by ``ucm serve``), the first
``/health`` call starts one short completion on the server itself (its key from ``VLLM_API_KEY``);
``/health`` answers 503 "warming up" until it finished. A failed warm-up is logged and serving starts
anyway: it must never keep an engine out of service.

The connector's scheduler half runs in vLLM's engine process; ``/health`` is answered by the API
server process. They share one small file (``UCM_STORE_HEALTH_FILE``, which ``ucm serve`` sets to a
fresh path per start): the scheduler writes it when a store call misses its deadline and removes
it when that call finally returns; ``HealthMiddleware`` (added with vLLM's ``--middleware``)
adds ``X-UCM-Store: degraded ...`` to ``/health``'s answer once the call has been stuck for
``store_unhealthy_after_s``. Each worker has a file of its own beside it (``<file>.worker<rank>``),
there while its store is degraded (``ucm.store.breaker``): one process's store answering again must
not clear another's.

The answer stays 200: the engine serves without the store (lookups are misses, loads are
recomputed, saves skipped), and a 503 would take every engine sharing the store out of service at
once — an outage, and liveness restarts that cure nothing. (It was 503 until
``benchmarks/fault_serving.py``'s store hangs showed exactly that: every request 503 for the rest of
the hang.) The proxy reads the header: a prefill whose store is degraded cannot pass its KV to a
decode, so requests go straight to decode, which computes the prompt.

**Pairing.** ``ucm serve`` puts the engine's pairing identity (``identity.pairing_identity``) in
``UCM_KV_IDENTITY``; a healthy ``/health`` answer carries it as ``X-UCM-KV-Identity``, which the
proxy reads in its health checks to pair prefills and decodes that can share KV.

**Drain.** On SIGTERM vLLM (``--shutdown-timeout``) finishes the requests it has but keeps its HTTP
server open, and answers each request that arrives meanwhile with a 200 and no text
(``finish_reason: abort``): a client takes that for an answer. From SIGTERM on, the middleware
answers ``/health`` and new POSTs with 503 (``Retry-After``), which the proxy retries elsewhere.
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

HEALTH_FILE_ENV = "UCM_STORE_HEALTH_FILE"
WARMUP_ENV = "UCM_ENGINE_WARMUP"
IDENTITY_ENV = "UCM_KV_IDENTITY"
IDENTITY_HEADER = b"x-ucm-kv-identity"
STORE_HEADER = b"x-ucm-store"  # "degraded; ..." while the store has been stuck past its limit
WORKER_SUFFIX = ".worker"
TMP_SUFFIX = ".tmp"
MIDDLEWARE = f"{__name__}.HealthMiddleware"
WARMUP_TIMEOUT_S = 300.0


class StoreHealth:
    """The scheduler's side, or with ``worker`` (its rank) a worker's: records when the store stopped
    answering (wall time, shared with the API server process) and when it answers again. Without
    the environment variable it does nothing: the engine was not started by ``ucm serve`` and
    nobody reads the file."""

    def __init__(
        self, unhealthy_after_s: float | None, environ: dict[str, str] | None = None, worker: int | None = None
    ) -> None:
        path = (os.environ if environ is None else environ).get(HEALTH_FILE_ENV)
        if path and worker is not None:
            path = f"{path}{WORKER_SUFFIX}{worker}"
        self.path = Path(path) if path and unhealthy_after_s is not None else None
        self.unhealthy_after_s = unhealthy_after_s

    def stuck(self, since: float) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        try:
            tmp.write_text(json.dumps({"since": since, "unhealthy_after_s": self.unhealthy_after_s}))
            tmp.replace(self.path)
        except OSError as exc:
            logger.warning("cannot record the store's state in %s: %s", self.path, exc)

    def answered(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def health_files(path: Path) -> list[Path]:
    """The scheduler's file and the workers' files present beside it."""
    workers = path.parent.glob(f"{glob.escape(path.name)}{WORKER_SUFFIX}*")
    return [path, *(p for p in workers if not p.name.endswith(TMP_SUFFIX))]


def stuck_for(path: Path, now: float | None = None) -> tuple[float, float] | None:
    """(seconds stuck, threshold) when the file says the store is stuck past its threshold."""
    try:
        state = json.loads(path.read_text())
        since, threshold = float(state["since"]), float(state["unhealthy_after_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent (healthy) or being replaced: the next probe reads it again
    stuck = (time.time() if now is None else now) - since
    return (stuck, threshold) if stuck >= threshold else None


class HealthMiddleware:
    """Pure ASGI middleware for vLLM's API server: ``GET /health`` is 503 while warming up and
    draining, and carries the engine's pairing identity and, while the store is stuck past its
    threshold, ``X-UCM-Store: degraded``; everything else passes through."""

    def __init__(self, app: Any) -> None:
        self.app = app
        path = os.environ.get(HEALTH_FILE_ENV)
        self.path = Path(path) if path else None
        self.warm = os.environ.get(WARMUP_ENV) != "1"
        self._warming: asyncio.Task[None] | None = None
        self.draining = False
        self.identity = os.environ.get(IDENTITY_ENV, "").encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            self._watch_for_sigterm()
        elif scope["type"] == "http" and self.draining and (scope["path"] == "/health" or scope["method"] == "POST"):
            await _unavailable(send, "shutting down: finishing the requests in flight")
            return
        if scope["type"] == "http" and scope["path"] == "/health":
            if not self.warm:
                if self._warming is None:
                    host, port = scope["server"]  # this server, as the probe reached it
                    self._warming = asyncio.create_task(self._warm_up(f"http://{host}:{port}"))
                await _unavailable(send, "warming up: the first request is on its way")
                return
            headers = [(IDENTITY_HEADER, self.identity)] if self.identity else []
            stuck = self._stuck()
            if stuck is not None:
                state = f"degraded; the KV store has not answered for {stuck[0]:.0f} s (limit {stuck[1]:g} s)"
                headers.append((STORE_HEADER, state.encode()))
            if headers:
                await self.app(scope, receive, _with_headers(send, headers))
                return
        await self.app(scope, receive, send)

    def _stuck(self) -> tuple[float, float] | None:
        """The longest a store has been stuck past its limit, by the scheduler's or a worker's file."""
        if self.path is None:
            return None
        return max((s for p in health_files(self.path) if (s := stuck_for(p)) is not None), default=None)

    def _watch_for_sigterm(self) -> None:
        """Mark the drain when SIGTERM arrives. The server's own handling goes on: asyncio learns of
        the signal from its wakeup fd, which the interpreter writes whatever the Python handler."""
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            self.draining = True
            if callable(previous):
                previous(signum, frame)

        try:
            signal.signal(signal.SIGTERM, on_sigterm)
        except ValueError:  # not the main thread: no drain marking, vLLM's own handling stays
            logger.warning("cannot watch for SIGTERM outside the main thread; requests during a drain get aborted")

    async def _warm_up(self, url: str) -> None:
        key = os.environ.get("VLLM_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        started = time.monotonic()
        try:
            async with aiohttp.ClientSession(
                headers=headers, timeout=aiohttp.ClientTimeout(total=WARMUP_TIMEOUT_S)
            ) as http:
                async with http.get(url + "/v1/models") as r:
                    r.raise_for_status()
                    model = (await r.json())["data"][0]["id"]
                # Shorter than a block: nothing is saved to or looked up in the shared store. With
                # logprobs: vLLM CPU's first request asking for them costs 2.8-3.6 s (measured), one
                # without them 0.05 s; the warm-up pays both.
                body = {"model": model, "prompt": "Warm up.", "max_tokens": 2, "temperature": 0, "logprobs": 1}
                async with http.post(url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
            logger.info("warm-up request done in %.2f s", time.monotonic() - started)
        except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError) as exc:
            logger.warning("warm-up request failed (serving without it): %s", exc or type(exc).__name__)
        finally:
            self.warm = True


def _with_headers(send: Any, headers: list[tuple[bytes, bytes]]) -> Any:
    async def send_with_headers(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *headers]}
        await send(message)

    return send_with_headers


async def _unavailable(send: Any, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
