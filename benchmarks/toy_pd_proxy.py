"""A re-implementation of vLLM's toy PD proxy, as the Python baseline of benchmarks/proxy_overhead.py.

It does what vLLM's test proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) does,
the way it does it: FastAPI with the request parsed by ``request.json()``, one httpx.AsyncClient
per backend, round robin per role, a prefill copy with max_tokens=1 / stream=false, then the
decode response streamed back with ``aiter_bytes`` in a StreamingResponse, under uvicorn's
defaults. Not part of UCM; only measured.

    python benchmarks/toy_pd_proxy.py --port P --prefill URL --decode URL
"""

from __future__ import annotations

import argparse
import itertools
import uuid
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def build(prefill: list[str], decode: list[str]) -> FastAPI:
    clients: dict[str, list[httpx.AsyncClient]] = {}
    turns: dict[str, itertools.cycle] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        for role, urls in (("prefill", prefill), ("decode", decode)):
            clients[role] = [httpx.AsyncClient(base_url=u + "/v1", timeout=None, limits=limits) for u in urls]
            turns[role] = itertools.cycle(range(len(urls)))
        yield
        for role_clients in clients.values():
            for c in role_clients:
                await c.aclose()

    app = FastAPI(lifespan=lifespan)

    def next_client(role: str) -> httpx.AsyncClient:
        return clients[role][next(turns[role])]

    async def handle(api: str, request: Request) -> StreamingResponse:
        req = await request.json()
        request_id = str(uuid.uuid4())
        headers = {"X-Request-Id": request_id}
        pre = dict(req)
        pre["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        pre["stream"] = False
        pre["max_tokens"] = 1
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        pre.pop("stream_options", None)
        resp = await next_client("prefill").post(api, json=pre, headers=headers)
        resp.raise_for_status()
        await resp.aread()
        params = resp.json().get("kv_transfer_params", {})
        await resp.aclose()
        if params:
            req["kv_transfer_params"] = params
        decode_client = next_client("decode")

        async def stream():  # type: ignore[no-untyped-def]
            async with decode_client.stream("POST", api, json=req, headers=headers) as r:
                r.raise_for_status()
                async for chunk in r.aiter_bytes():
                    yield chunk

        return StreamingResponse(stream(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return await handle("/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        return await handle("/chat/completions", request)

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", nargs="+", required=True)
    parser.add_argument("--decode", nargs="+", required=True)
    args = parser.parse_args()
    uvicorn.run(build(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
