"""A fake vLLM OpenAI server (aiohttp) for proxy tests and benchmarks: instant, scriptable failures.

It speaks the parts of vLLM's API the proxy uses: ``/v1/completions`` and
``/v1/chat/completions`` (JSON or SSE), ``/v1/models``, ``/health``; a prefill request
(``kv_transfer_params.do_remote_decode``) is answered with ``kv_transfer_params`` naming this
backend and promising ``ucm_blocks``, and a decode request's ``kv_transfer_params`` are echoed
back, so tests can follow them; a decode given promised blocks reports them in
``kv_transfer_params.ucm_loaded_tokens`` (16 tokens a block), as UCM's connector does. A request
vLLM's own validation would refuse in a way a proxy could cause (``min_tokens`` above the token
limit, as in a one-token prefill copy) gets vLLM's 400. LoRA adapters (``Behaviour.adapters``) are
served under their own names and listed in ``/v1/models`` as vLLM lists them; a model it does not
serve gets vLLM's 404; ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change them, as
vLLM's runtime adapter loading does (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), and are recorded as
requests, so tests can tell whether anything reached them.

Run standalone (benchmarks): ``python -m ucm_testing.fake_vllm --port P --name decode``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODEL = "fake-model"


@dataclass
class Behaviour:
    """What the next requests get. ``fail_next`` entries are consumed one request each."""

    chunks: int = 16
    delay_s: float = 0.0  # before answering
    chunk_delay_s: float = 0.0
    # "500", "close", "mid_stream", "hang", "400", "abort" (vLLM's answer to a request it refused)
    fail_next: list[str] = field(default_factory=list)
    healthy: bool = True
    saves: bool = True  # as prefill: promises blocks (false: its saves are failing)
    loads: bool = True  # as decode: reuses promised blocks (false: computes the whole prompt)
    identity: str | None = None  # its pairing identity, sent with /health as ucm serve's engines do
    store_degraded: bool = False  # its /health says X-UCM-Store: degraded, as ucm serve's engines do
    # What its /metrics reports as vLLM's gauges (as if another proxy had requests on it).
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters served: name -> path


class FakeVLLM:
    def __init__(self, name: str = "fake", behaviour: Behaviour | None = None) -> None:
        self.name = name
        self.behaviour = behaviour or Behaviour()
        self.requests: list[dict[str, Any]] = []  # {"path", "body", "headers"}
        self.cancelled = 0
        self.probes = 0  # GET /health and /v1/models
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self._unload_adapter)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.app = app
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeVLLM:
        # handler_cancellation: a client (the proxy) closing the connection cancels the handler, as
        # it aborts the request in vLLM.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        self.probes += 1
        headers = {}
        if self.behaviour.identity:
            headers["X-UCM-KV-Identity"] = self.behaviour.identity
        if self.behaviour.store_degraded:
            headers["X-UCM-Store"] = "degraded; the KV store has not answered for 40 s (limit 30 s)"
        return web.Response(status=200 if self.behaviour.healthy else 503, headers=headers)

    async def _metrics(self, request: web.Request) -> web.Response:
        b = self.behaviour
        labels = f'{{engine="0",model_name="{MODEL}"}}'
        lines = [
            f"vllm:num_requests_running{labels} {float(b.running)}",
            f"vllm:num_requests_waiting{labels} {float(b.waiting)}",
            f"vllm:kv_cache_usage_perc{labels} {b.kv_usage}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        self.probes += 1
        adapters = [
            {"id": name, "object": "model", "root": path, "parent": MODEL}
            for name, path in self.behaviour.adapters.items()
        ]
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}, *adapters]})

    async def _record(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON body, after recording the request."""
        body = await request.json()
        # Header names as a client would look them up (HTTP names are case-insensitive).
        headers = {k.title(): v for k, v in request.headers.items()}
        self.requests.append({"path": request.path, "body": body, "headers": headers})
        return body

    async def _load_adapter(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        self.behaviour.adapters[body["lora_name"]] = body["lora_path"]
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def _unload_adapter(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        self.behaviour.adapters.pop(body["lora_name"], None)
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        model = body.get("model")
        if model != MODEL and model not in self.behaviour.adapters:
            error = {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": "model"}
            return web.json_response({"error": {**error, "code": 404}}, status=404)
        refusal = _refusal(body)
        if refusal is not None:
            return web.json_response(
                {"error": {"message": refusal, "type": "BadRequestError", "code": 400}}, status=400
            )
        b = self.behaviour
        failure = b.fail_next.pop(0) if b.fail_next else None
        if failure == "500":
            return web.json_response({"error": {"message": "engine error"}}, status=500)
        if failure == "400":
            return web.json_response({"error": {"message": "prompt too long", "code": 400}}, status=400)
        if failure == "close":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if failure == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if b.delay_s:
            try:
                await asyncio.sleep(b.delay_s)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        chat = request.path.endswith("/chat/completions")
        if failure == "abort":
            return await self._aborted(request, chat, bool(body.get("stream")))
        n = min(int(body.get("max_tokens") or body.get("max_completion_tokens") or b.chunks), b.chunks)
        params_in = body.get("kv_transfer_params") or {}
        params_out: Any = params_in
        if params_in.get("do_remote_decode"):
            params_out = {"do_remote_prefill": True, "ucm_blocks": 3 if b.saves else 0, "prefilled_by": self.name}
        if params_in.get("do_remote_prefill"):
            promised = params_in.get("ucm_blocks")
            loaded = 16 * promised if b.loads and isinstance(promised, int) else 0
            params_out = {**params_in, "ucm_loaded_tokens": loaded}
        if body.get("stream"):
            return await self._stream(request, chat, model, n, params_out, failure == "mid_stream")
        text = "".join(f" t{i}" for i in range(n))
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return web.json_response(
            {
                "id": f"cmpl-{self.name}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
                "kv_transfer_params": params_out,
                "served_by": self.name,
            }
        )

    async def _aborted(self, request: web.Request, chat: bool, stream: bool) -> web.StreamResponse:
        """What vLLM answers for a request it aborted before any token (one it refused while
        shutting down, say): a 200 with no text."""
        empty = {"delta": {"content": ""}} if chat else {"text": ""}
        choice = {"index": 0, **empty, "finish_reason": "abort"}
        if not stream:
            return web.json_response({"id": f"cmpl-{self.name}", "choices": [choice], "served_by": self.name})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": f"cmpl-{self.name}", "choices": [choice]}
        await resp.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def _stream(
        self, request: web.Request, chat: bool, model: str, n: int, params: Any, die: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(n):
                if die and i == 2:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                delta = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                chunk = {
                    "id": f"cmpl-{self.name}",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "model": model,
                    "choices": [{"index": 0, **delta, "finish_reason": None}],
                    "served_by": self.name,
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if self.behaviour.chunk_delay_s:
                    await asyncio.sleep(self.behaviour.chunk_delay_s)
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        return resp


def _refusal(body: dict[str, Any]) -> str | None:
    """vLLM's 400 for a request whose ``min_tokens`` exceeds its token limit (SamplingParams)."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and isinstance(limit, int) and min_tokens > limit:
        return f"min_tokens must be less than or equal to max_tokens={limit}, got {min_tokens}."
    return None


class FakeVLLMThread:
    """Fake servers on an event loop in a background thread, for synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.servers: list[FakeVLLM] = []

    def add(self, name: str, behaviour: Behaviour | None = None, port: int = 0) -> FakeVLLM:
        server = FakeVLLM(name, behaviour)
        asyncio.run_coroutine_threadsafe(server.start(port), self.loop).result(10)
        self.servers.append(server)
        return server

    def remove(self, server: FakeVLLM) -> None:
        asyncio.run_coroutine_threadsafe(server.stop(), self.loop).result(10)
        self.servers.remove(server)

    def close(self) -> None:
        for s in list(self.servers):
            self.remove(s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake vLLM OpenAI server")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--chunks", type=int, default=16)
    args = parser.parse_args()
    server = FakeVLLM(args.name, Behaviour(chunks=args.chunks))
    web.run_app(server.app, host="127.0.0.1", port=args.port, access_log=None, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
