"""LoRA adapters through the proxy, against fake engines that serve them as vLLM does: listed in
/v1/models, served through PD under their own name, routed to where their KV is, never loaded or
unloaded through the proxy."""

import json
import time

import pytest

from tests.proxy.test_proxy import sse_events
from ucm.deploy.ports import free_port
from ucm_proxy.kvindex import BlockStored, EventBatch
from ucm_testing.fake_vllm import MODEL, Behaviour

ADAPTERS = {"ad": "/adapters/ad"}
TOKENS = list(range(100, 164))  # a prompt of token ids: kv_aware needs no /tokenize
BS = 16


def serving(adapters: dict[str, str]) -> Behaviour:
    return Behaviour(adapters=dict(adapters))


def wait_models(client, n: int) -> list[dict]:
    """The proxy's /v1/models once the health checks have learned ``n`` models."""
    deadline = time.monotonic() + 10
    while len(data := client.get("/v1/models").json()["data"]) < n:
        assert time.monotonic() < deadline, f"the proxy lists {data}"
        time.sleep(0.05)
    return data


def test_models_lists_every_backends_adapters_with_their_parent(fakes, make_proxy):
    p = fakes.add("p", serving(ADAPTERS))
    d = fakes.add("d", serving({**ADAPTERS, "bd": "/adapters/bd"}))
    proxy = make_proxy(prefill=[p.url], decode=[d.url])
    with proxy.client() as c:
        data = wait_models(c, 3)
    assert data == [
        {"id": "ad", "object": "model", "owned_by": "ucm", "parent": MODEL, "root": "/adapters/ad"},
        {"id": "bd", "object": "model", "owned_by": "ucm", "parent": MODEL, "root": "/adapters/bd"},
        {"id": MODEL, "object": "model", "owned_by": "ucm"},
    ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", {"model": "ad", "prompt": "Hello there", "max_tokens": 4}),
        ("/v1/chat/completions", {"model": "ad", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    ],
)
def test_an_adapters_request_goes_through_prefill_and_decode_under_its_name(fakes, make_proxy, route, body, stream):
    p, d = fakes.add("p", serving(ADAPTERS)), fakes.add("d", serving(ADAPTERS))
    proxy = make_proxy(prefill=[p.url], decode=[d.url])
    with proxy.client() as c:
        wait_models(c, 2)
        r = c.post(route, json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    [pre], [dec] = p.requests, d.requests
    assert pre["body"]["model"] == dec["body"]["model"] == "ad"
    assert pre["body"]["kv_transfer_params"] == {"do_remote_decode": True}
    assert dec["body"]["kv_transfer_params"]["prefilled_by"] == "p"  # decode loads what prefill computed
    answers = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"] if stream else [r.json()]
    assert answers and all(a["model"] == "ad" for a in answers)


def test_a_model_no_backend_serves_is_refused_before_any_engine(fakes, make_proxy):
    p, d = fakes.add("p", serving(ADAPTERS)), fakes.add("d", serving(ADAPTERS))
    proxy = make_proxy(prefill=[p.url], decode=[d.url])
    with proxy.client() as c:
        wait_models(c, 2)
        r = c.post("/v1/completions", json={"model": "bd", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert p.requests == d.requests == []


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_runtime_adapter_loading_is_not_reachable_through_the_proxy(fakes, make_proxy, path):
    p, d = fakes.add("p", serving(ADAPTERS)), fakes.add("d", serving(ADAPTERS))
    mixed = fakes.add("m", serving(ADAPTERS))
    for proxy in (make_proxy(prefill=[p.url], decode=[d.url]), make_proxy(mode="mixed", decode=[mixed.url])):
        with proxy.client() as c:
            wait_models(c, 2)
            for method in ("POST", "PUT", "GET"):
                r = c.request(method, path, json={"lora_name": "evil", "lora_path": "/tmp/evil"})
                assert r.status_code in (404, 405), (method, r.status_code)
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["ad", MODEL]
    assert [r for s in (p, d, mixed) for r in s.requests] == []
    assert all(s.behaviour.adapters == ADAPTERS for s in (p, d, mixed))


def stored(hashes: list[bytes], tokens: list[int], lora: str | None) -> EventBatch:
    """Blocks as vLLM announces them, with the adapter's name in every block's extra keys."""
    extra = [[lora] if lora else None for _ in hashes]
    return EventBatch(0.0, [BlockStored(hashes, None, tokens, BS, "GPU", extra, lora_name=lora)])


def test_kv_aware_sends_an_adapters_prompt_where_that_adapter_computed_it(fakes, make_proxy):
    """Engine a holds the prompt's blocks on the base model, engine b under adapter ad: each
    request goes where its own KV is, whatever the other's blocks say."""
    a, b = fakes.add("a", serving(ADAPTERS)), fakes.add("b", serving(ADAPTERS))
    # No engine publishes here: the index is fed by hand, its publishers never connect.
    endpoints = {s.url: {"events": f"tcp://127.0.0.1:{free_port()}"} for s in (a, b)}
    proxy = make_proxy(
        mode="mixed",
        decode=[a.url, b.url],
        routing={"kv_events": {"endpoints": endpoints}, "engine_metrics_interval_s": 0},
    )
    index = proxy.proxy.followers.index
    index.apply(a.url, stored([b"a1", b"a2", b"a3"], TOKENS[:48], None))
    index.apply(b.url, stored([b"b1", b"b2"], TOKENS[:32], "ad"))
    with proxy.client() as c:
        wait_models(c, 2)
        for model, engine in (("ad", "b"), (MODEL, "a"), ("ad", "b"), (MODEL, "a")):
            r = c.post("/v1/completions", json={"model": model, "prompt": TOKENS, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["served_by"] == engine, model
