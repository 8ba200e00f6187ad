"""The operator's API client turns every failure into an ApiError the handlers can act on: error
pages that are not JSON, timeouts and refused connections; and tells permanent refusals from
what is worth retrying. Against a real HTTP server on loopback."""

from __future__ import annotations

import asyncio

import kopf
import pytest
import pytest_asyncio
from aiohttp import web

from ucm.deploy.ports import free_port
from ucm_operator.api import Api, ApiError


@pytest_asyncio.fixture
async def server():
    async def error_page(request: web.Request) -> web.Response:
        return web.Response(status=502, text="<html>Bad gateway</html>", content_type="text/html")

    async def invalid(request: web.Request) -> web.Response:
        return web.json_response({"kind": "Status", "message": "env[0].name: Invalid value: '1x'"}, status=422)

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/api/v1/namespaces/a/configmaps", error_page)
    app.router.add_post("/api/v1/namespaces/b/configmaps", invalid)
    app.router.add_post("/api/v1/namespaces/c/configmaps", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def api_for(url: str) -> Api:
    api = Api()
    api.connect(kopf.ConnectionInfo(server=url, insecure=True))
    return api


def config_map(namespace: str) -> dict:
    return {"kind": "ConfigMap", "metadata": {"name": "x", "namespace": namespace}}


@pytest.mark.asyncio
async def test_an_error_page_that_is_not_json_is_an_api_error(server):
    api = api_for(server)
    with pytest.raises(ApiError) as failed:
        await api.create(config_map("a"))
    assert failed.value.status == 502 and "Bad gateway" in str(failed.value) and not failed.value.permanent
    await api.close()


@pytest.mark.asyncio
async def test_a_refusal_is_permanent_and_names_the_problem(server):
    api = api_for(server)
    with pytest.raises(ApiError) as failed:
        await api.create(config_map("b"))
    assert failed.value.status == 422 and failed.value.permanent and "env[0].name" in str(failed.value)
    await api.close()


@pytest.mark.asyncio
async def test_timeouts_and_refused_connections_are_api_errors_worth_retrying(server, monkeypatch):
    api = api_for(server)
    session = api._http()
    session._timeout = type(session.timeout)(total=0.3)
    with pytest.raises(ApiError) as failed:
        await api.create(config_map("c"))
    assert failed.value.status == 0 and not failed.value.permanent
    await api.close()
    nobody = api_for(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ApiError) as failed:
        await nobody.create(config_map("a"))
    assert failed.value.status == 0 and "no answer" in str(failed.value)
    await nobody.close()


@pytest.mark.parametrize(
    ("status", "permanent"),
    [
        (400, True),
        (403, True),
        (422, True),
        (404, True),
        (408, False),
        (409, False),
        (429, False),
        (500, False),
        (0, False),
    ],
)
def test_which_failures_are_permanent(status, permanent):
    assert ApiError(status, "POST", "/x", "").permanent is permanent
