"""kv_aware routing against real vLLM engines (CPU build) publishing their KV events.

Two engines, A and B, listed in that order; B with the UCM connector on a store; both serve the
LoRA adapter ``ad``. Each test first warms a prompt on B directly (not through the proxy), so that
only B's KV events can say where it is: any policy blind to them sends the next request to A (equal
load: the first), where nothing is cached. The engines' own ``cached_tokens`` tell where a request
ran.
"""

from __future__ import annotations

import time
import urllib.request

import pytest

from ucm.deploy.demo_model import TINY
from ucm.deploy.plan import kv_events_config
from ucm.deploy.ports import free_port
from ucm.integration.vllm.config import kv_transfer_config
from ucm_testing.adapters import ensure_adapter
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer, cached_tokens

pytestmark = [pytest.mark.slow, pytest.mark.engines]
BS = 32


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    adapter = ensure_adapter(TINY, 1, tmp_path_factory.mktemp("adapters"))
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"ad={adapter}"]
    servers = {}
    # B runs the UCM connector on a store: its connector announces the store's blocks too.
    store = {"spec": "posix", "posix": {"roots": [str(tmp_path_factory.mktemp("kv-store"))]}}
    for name, kv in (("A", None), ("B", kv_transfer_config(store, "kv_both"))):
        port, replay = free_port(), free_port()
        server = VLLMServer(
            tiny_model,
            logs / f"{name}.log",
            kv_transfer_config=kv,
            extra_args=[*lora, "--kv-events-config", kv_events_config(f"tcp://*:{port}", f"tcp://*:{replay}")],
        )
        server.env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache, to check that clears reach the index
        server.events = {"events": f"tcp://127.0.0.1:{port}", "replay": f"tcp://127.0.0.1:{replay}"}
        servers[name] = server
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture
def kv_proxy(engines, make_proxy):
    a, b = engines["A"], engines["B"]

    def make():
        proxy = make_proxy(
            mode="mixed",
            decode=[a.url, b.url],
            routing={"kv_events": {"endpoints": {a.url: a.events, b.url: b.events}}, "engine_metrics_interval_s": 0},
        )
        # A PUB socket drops what it sends before a subscriber has joined: warm-ups wait for the streams.
        wait_for(lambda: all(proxy.proxy.followers.connected(e.url) for e in (a, b)))
        return proxy

    return make


def through(proxy, body: dict, route: str = "/v1/completions") -> dict:
    with proxy.client(timeout=120) as c:
        r = c.post(route, json=body)
        assert r.status_code == 200, r.text
        return r.json()


def index_blocks(proxy, url: str) -> int:
    engine = proxy.proxy.followers.index.engines.get(url)
    return 0 if engine is None else len(engine)


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_prompt_goes_to_the_engine_that_holds_its_prefix(engines, kv_proxy):
    b = engines["B"]
    proxy = kv_proxy()  # started before the warm-up: it learns from live events
    prompt = PROMPTS[0]
    b.complete(prompt, max_tokens=1)
    wait_for(lambda: index_blocks(proxy, b.url) >= 3)
    r = through(proxy, {"model": b.model, "prompt": prompt + " and then", "max_tokens": 4, "temperature": 0})
    assert cached_tokens(r) >= 3 * BS  # it ran on B, from B's prefix cache


def test_a_restarted_proxy_knows_at_once_from_the_replay(engines, kv_proxy):
    b = engines["B"]
    prompt = PROMPTS[1]
    b.complete(prompt, max_tokens=1)  # no proxy is listening
    proxy = kv_proxy()  # connected means B's replay applied: no need to wait for B's next event
    r = through(proxy, {"model": b.model, "prompt": prompt + " and then", "max_tokens": 4, "temperature": 0})
    assert cached_tokens(r) >= 3 * BS


def test_another_tenants_prefix_does_not_attract_a_request(engines, kv_proxy):
    b = engines["B"]
    proxy = kv_proxy()
    prompt = PROMPTS[3]
    b.complete(prompt, max_tokens=1, cache_salt="tenant-b")
    wait_for(lambda: index_blocks(proxy, b.url) >= 3)
    body = {"model": b.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "cache_salt": "tenant-a"}
    r = through(proxy, body)
    assert cached_tokens(r) == 0
    r = through(proxy, {**body, "cache_salt": "tenant-b"})
    assert cached_tokens(r) >= 3 * BS


def test_chat_prompts_are_matched_through_the_engines_chat_template(engines, kv_proxy):
    b = engines["B"]
    proxy = kv_proxy()
    messages = [{"role": "user", "content": PROMPTS[4]}]
    b.post("/v1/chat/completions", {"model": b.model, "messages": messages, "max_tokens": 1})
    wait_for(lambda: index_blocks(proxy, b.url) >= 3)
    r = through(proxy, {"model": b.model, "messages": messages, "max_tokens": 4}, "/v1/chat/completions")
    assert cached_tokens(r) >= 3 * BS


def test_a_cleared_cache_empties_the_engines_entries(engines, kv_proxy):
    b = engines["B"]
    proxy = kv_proxy()
    index = proxy.proxy.followers.index

    def held(prompt: str) -> int:
        tokens = b.post("/tokenize", {"model": b.model, "prompt": prompt})["tokens"]
        return index.cached([b.url], tokens, None).get(b.url, (0, 0))[0]  # B's own cache

    b.complete(PROMPTS[5], max_tokens=1)
    wait_for(lambda: held(PROMPTS[5]) >= 3 * BS)
    urllib.request.urlopen(urllib.request.Request(b.url + "/reset_prefix_cache", method="POST"), timeout=10)
    # vLLM publishes a step's events with the step: the clear goes out with the next request's blocks.
    b.complete(PROMPTS[6], max_tokens=1)
    wait_for(lambda: held(PROMPTS[6]) >= 3 * BS)
    assert held(PROMPTS[5]) == 0


def test_the_connector_announces_what_the_store_holds_for_any_engine(engines, kv_proxy):
    a, b = engines["A"], engines["B"]
    proxy = kv_proxy()
    index = proxy.proxy.followers.index
    tokens = b.post("/tokenize", {"model": b.model, "prompt": PROMPTS[7]})["tokens"]
    b.complete(PROMPTS[7], max_tokens=1)  # B computes it and saves its full blocks to the store
    full = len(tokens) // BS * BS
    wait_for(lambda: index.cached([a.url], tokens, None).get(a.url) == (0, full))  # A could load them


def test_an_adapters_prompt_goes_where_that_adapter_computed_it(engines, kv_proxy):
    b = engines["B"]
    proxy = kv_proxy()
    index = proxy.proxy.followers.index
    wait_for(lambda: proxy.proxy.models.adapter("ad") == "ad")  # its card, from the health checks
    prompt = PROMPTS[8]
    tokens = b.post("/tokenize", {"model": "ad", "prompt": prompt})["tokens"]
    full = len(tokens) // BS * BS

    def held(adapter: str | None) -> int:
        return index.cached([b.url], tokens, None, adapter).get(b.url, (0, 0))[0]  # B's own cache

    b.complete(prompt, max_tokens=1, model="ad")
    wait_for(lambda: held("ad") == full)
    assert held(None) == 0  # the base model's prompt: none of the adapter's blocks are its KV
    r = through(proxy, {"model": "ad", "prompt": prompt + " and then", "max_tokens": 4, "temperature": 0})
    assert cached_tokens(r) >= 3 * BS  # it ran on B, from the adapter's blocks
