"""The PD proxy against fake vLLM backends over real HTTP: the request path, routing, failures."""

import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from ucm.config import ConfigError, parse_config
from ucm_proxy.config import ProxyConfig
from ucm_testing.fake_vllm import MODEL, Behaviour

pytestmark = pytest.mark.engines  # times things tightly: make test runs it alone (ucm_testing.lanes)

COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 5}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4}


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture
def pd(fakes, make_proxy):
    p1, p2 = fakes.add("p1"), fakes.add("p2")
    d1, d2 = fakes.add("d1"), fakes.add("d2")
    proxy = make_proxy(
        prefill=[p1.url, p2.url], decode=[d1.url, d2.url], routing={"prefill": "round_robin", "decode": "round_robin"}
    )
    return proxy, (p1, p2), (d1, d2)


def all_requests(servers):
    return [r for s in servers for r in s.requests]


def test_pd_completion_sends_prefill_then_decode_with_its_params(pd):
    proxy, prefills, decodes = pd
    with proxy.client() as c:
        r = c.post(
            "/v1/completions",
            json={**COMPLETION, "stream_options": {"include_usage": True}},
            headers={"X-Request-Id": "req-42", "Authorization": "Bearer user-token"},
        )
    assert r.status_code == 200, r.text
    [pre] = all_requests(prefills)
    [dec] = all_requests(decodes)
    assert pre["body"]["max_tokens"] == 1 and pre["body"]["stream"] is False
    assert "stream_options" not in pre["body"]
    assert pre["body"]["kv_transfer_params"] == {"do_remote_decode": True}
    params = dec["body"]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["prefilled_by"] in ("p1", "p2")
    assert dec["body"]["max_tokens"] == 5 and dec["body"]["stream_options"] == {"include_usage": True}
    for req in (pre, dec):
        assert req["headers"]["X-Request-Id"] == "req-42"
        assert "Authorization" not in req["headers"]  # the client's key is the proxy's business
    assert r.headers["x-request-id"] == "req-42"
    assert r.json()["choices"][0]["text"] == " t0 t1 t2 t3 t4"


def test_backends_get_the_deployments_key_never_the_clients(fakes, make_proxy, tmp_path):
    (tmp_path / "backend-key").write_text("engine-secret\n")
    p, d = fakes.add("p"), fakes.add("d")
    proxy = make_proxy(prefill=[p.url], decode=[d.url], backend_api_key_file=str(tmp_path / "backend-key"))
    with proxy.client() as c:
        r = c.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer user-token"})
    assert r.status_code == 200, r.text
    for req in all_requests([p, d]):
        assert req["headers"]["Authorization"] == "Bearer engine-secret"


def test_request_id_is_created_when_absent(pd):
    proxy, prefills, decodes = pd
    with proxy.client() as c:
        r = c.post("/v1/completions", json=COMPLETION)
    rid = r.headers["x-request-id"]
    assert len(rid) >= 16
    assert all_requests(prefills)[0]["headers"]["X-Request-Id"] == rid
    assert all_requests(decodes)[0]["headers"]["X-Request-Id"] == rid


def test_pd_chat_caps_max_completion_tokens_for_prefill(pd):
    proxy, prefills, decodes = pd
    with proxy.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    [pre] = all_requests(prefills)
    assert pre["body"]["max_completion_tokens"] == 1 and pre["body"]["max_tokens"] == 1
    assert all_requests(decodes)[0]["body"]["max_completion_tokens"] == 4
    assert r.json()["choices"][0]["message"]["content"] == " t0 t1 t2 t3"


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", {**COMPLETION, "min_tokens": 3, "logprobs": 2, "stop": ["\n"]}),
        ("/v1/chat/completions", {**CHAT, "min_tokens": 3, "logprobs": True, "top_logprobs": 2}),
    ],
)
def test_pd_prefill_copy_leaves_output_constraints_to_decode(pd, route, body):
    """vLLM refuses min_tokens above a prefill's one token (the fake engines do too): PD requests
    with it were answered 400."""
    proxy, prefills, decodes = pd
    with proxy.client() as c:
        r = c.post(route, json=body)
    assert r.status_code == 200, r.text
    [pre], [dec] = all_requests(prefills), all_requests(decodes)
    assert not {"min_tokens", "logprobs", "top_logprobs", "stop"} & pre["body"].keys()
    assert dec["body"]["min_tokens"] == 3 and dec["body"]["logprobs"] == body["logprobs"]


def test_streaming_is_passed_through_chunk_by_chunk(fakes, make_proxy):
    p = fakes.add("p")
    d = fakes.add("d", Behaviour(chunks=6, chunk_delay_s=0.15))
    proxy = make_proxy(prefill=[p.url], decode=[d.url])
    arrivals = []
    with (
        proxy.client() as c,
        c.stream("POST", "/v1/completions", json={**COMPLETION, "max_tokens": 6, "stream": True}) as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_bytes():
            arrivals.append((time.monotonic(), chunk))
    events = sse_events(b"".join(c for _, c in arrivals).decode())
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [f" t{i}" for i in range(6)]
    # Not buffered whole: the chunks arrived spread over the backend's pacing.
    assert arrivals[-1][0] - arrivals[0][0] > 0.5
    assert p.requests[0]["body"]["stream"] is False


def test_mixed_mode_forwards_the_request_unchanged(fakes, make_proxy):
    a, b = fakes.add("a"), fakes.add("b")
    proxy = make_proxy(mode="mixed", decode=[a.url, b.url], routing={"decode": "round_robin"})
    with proxy.client() as c:
        for _ in range(4):
            assert c.post("/v1/completions", json=COMPLETION).status_code == 200
    assert len(a.requests) == 2 and len(b.requests) == 2
    assert all(r["body"] == COMPLETION for r in a.requests + b.requests)


def test_a_whole_answer_larger_than_max_response_bytes_is_a_502_and_a_stream_still_flows(fakes, make_proxy):
    """A non-streamed answer is held whole: the proxy refuses to hold more than max_response_bytes
    (instead of growing without bound) and says how to get it; streamed, the same answer passes."""
    d = fakes.add("d", Behaviour(chunks=200_000))  # " t0 t1 ...": ~1.3 MB of text
    proxy = make_proxy(mode="mixed", decode=[d.url], max_response_bytes=1 << 20)
    big = {**COMPLETION, "max_tokens": 200_000}
    with proxy.client() as c:
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 502, r.text
        assert "max_response_bytes" in r.json()["error"]["message"] and "stream" in r.json()["error"]["message"]
        assert len(d.requests) == 1  # not retried elsewhere: any backend would answer as much
        small = c.post("/v1/completions", json=COMPLETION)
        assert small.status_code == 200
        with c.stream("POST", "/v1/completions", json={**big, "stream": True}) as s:
            assert s.status_code == 200 and sum(len(x) for x in s.iter_bytes()) > 1 << 20


FORGED = {"do_remote_prefill": True, "ucm_blocks": 1_000_000}


def test_a_clients_kv_transfer_params_never_reach_decode(fakes, make_proxy):
    """Only a prefill's answer says where decode's KV comes from; a forged one would make decode
    wait for a million blocks nobody writes."""
    d, m = fakes.add("d"), fakes.add("m")
    fallback = make_proxy(prefill=[], decode=[d.url], fallback_to_decode=True)
    mixed = make_proxy(mode="mixed", decode=[m.url])
    for proxy in (fallback, mixed):
        with proxy.client() as c:
            for stream in (False, True):
                r = c.post("/v1/completions", json={**COMPLETION, "stream": stream, "kv_transfer_params": FORGED})
                assert r.status_code == 200, r.text
    assert all("kv_transfer_params" not in r["body"] for r in d.requests + m.requests)


def test_pd_replaces_a_clients_kv_transfer_params_with_the_prefills(pd):
    proxy, prefills, decodes = pd
    with proxy.client() as c:
        assert c.post("/v1/completions", json={**COMPLETION, "kv_transfer_params": FORGED}).status_code == 200
    [pre], [dec] = all_requests(prefills), all_requests(decodes)
    assert pre["body"]["kv_transfer_params"] == {"do_remote_decode": True}
    assert dec["body"]["kv_transfer_params"]["prefilled_by"] in ("p1", "p2")


def test_a_clients_chunk_boundaries_reach_the_engine_that_computes_the_prompt(pd, fakes, make_proxy):
    """Blend's explicit chunks: the proxy checks ``ucm_chunks`` and hands them to the engine in
    kv_transfer_params, where the connector reads them (a client cannot send those through it)."""
    chunks = [[0, 2], [3, 5]]
    body = {**COMPLETION, "prompt": [5, 6, 7, 8, 9, 10], "ucm_chunks": chunks}
    proxy, prefills, decodes = pd
    m = fakes.add("m")
    mixed = make_proxy(mode="mixed", decode=[m.url])
    for running in (proxy, mixed):
        with running.client() as c:
            assert c.post("/v1/completions", json=body).status_code == 200
    [pre], [dec] = all_requests(prefills), all_requests(decodes)
    assert pre["body"]["kv_transfer_params"] == {"do_remote_decode": True, "ucm_chunks": chunks}
    assert "ucm_chunks" not in dec["body"]["kv_transfer_params"]  # decode loads what prefill blended
    [plain] = m.requests
    assert plain["body"]["kv_transfer_params"] == {"ucm_chunks": chunks}
    assert all("ucm_chunks" not in r["body"] for r in (pre, dec, plain))
    # a PD request that decode computes itself (no prefill left), and a client's own params beside
    d = fakes.add("d")
    fallback = make_proxy(prefill=[], decode=[d.url], fallback_to_decode=True)
    with fallback.client() as c:
        assert c.post("/v1/completions", json={**body, "kv_transfer_params": FORGED}).status_code == 200
        assert c.post("/v1/completions", json={**body, "ucm_chunks": None}).status_code == 200
    with_chunks, without = (r["body"] for r in d.requests)
    assert with_chunks["kv_transfer_params"] == {"ucm_chunks": chunks}
    assert "kv_transfer_params" not in without and "ucm_chunks" not in without


def test_non_streamed_answers_say_they_are_json(pd):
    proxy, _, _ = pd
    with proxy.client() as c:
        r = c.post("/v1/completions", json=COMPLETION)
    assert r.headers["content-type"].startswith("application/json")


def test_prefix_affinity_keeps_a_prefix_on_one_backend(fakes, make_proxy):
    ps = [fakes.add(f"p{i}") for i in range(3)]
    d = fakes.add("d")
    proxy = make_proxy(prefill=[p.url for p in ps], decode=[d.url], routing={"prefill": "prefix_affinity"})
    with proxy.client() as c:
        for i in range(6):
            c.post("/v1/completions", json={**COMPLETION, "prompt": "Shared system prompt. " * 40 + f"q{i}"})
        for i in range(12):
            c.post("/v1/completions", json={**COMPLETION, "prompt": f"Unrelated prompt number {i}"})
    counts = [len(p.requests) for p in ps]
    shared = [p for p in ps if any(r["body"]["prompt"].startswith("Shared") for r in p.requests)]
    assert len(shared) == 1  # one backend owns the shared prefix
    assert sum(1 for p in ps if p.requests) >= 2  # other prompts spread
    assert sum(counts) == 18


def test_least_outstanding_avoids_the_busy_backend(fakes, make_proxy):
    slow = fakes.add("slow", Behaviour(delay_s=1.0))
    fast = fakes.add("fast")
    proxy = make_proxy(mode="mixed", decode=[slow.url, fast.url], routing={"decode": "least_outstanding"})
    import threading

    with proxy.client() as c:
        t = threading.Thread(target=lambda: c.post("/v1/completions", json=COMPLETION))
        t.start()
        time.sleep(0.2)
        for _ in range(3):
            assert c.post("/v1/completions", json=COMPLETION).json()["served_by"] == "fast"
        t.join()
    assert len(slow.requests) == 1


def test_prefill_failure_is_retried_on_another_prefill(fakes, make_proxy):
    bad = fakes.add("bad", Behaviour(fail_next=["500"]))
    good, d = fakes.add("good"), fakes.add("d")
    proxy = make_proxy(prefill=[bad.url, good.url], decode=[d.url], routing={"prefill": "round_robin"})
    with proxy.client() as c:
        r = c.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200
    assert d.requests[0]["body"]["kv_transfer_params"]["prefilled_by"] == "good"


def test_no_prefill_gives_503_or_decode_only_with_fallback(fakes, make_proxy):
    down = fakes.add("down", Behaviour(fail_next=["close"] * 10))
    d = fakes.add("d")
    strict = make_proxy(prefill=[down.url], decode=[d.url], retries=0)
    with strict.client() as c:
        r = c.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["message"] == "No prefill backend is available; retry shortly."
    lenient = make_proxy(prefill=[down.url], decode=[d.url], retries=0, fallback_to_decode=True)
    with lenient.client() as c:
        before = series(c.get("/metrics").text, FALLBACKS)
        r = c.post("/v1/completions", json=COMPLETION)
        after = series(c.get("/metrics").text, FALLBACKS)
    assert r.status_code == 200
    assert "kv_transfer_params" not in d.requests[-1]["body"]
    assert after == before + 1  # the counter is the process's: other tests count too


FALLBACKS = 'ucm_proxy_requests_total{path="fallback",route="/v1/completions",status="200"}'


def series(text: str, name: str) -> float:
    """One series' value in a /metrics page (0 when absent)."""
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


@pytest.mark.parametrize("failure", ["500", "close", "abort"])
@pytest.mark.parametrize("stream", [False, True])
def test_decode_failure_before_first_byte_is_retried(fakes, make_proxy, failure, stream):
    p = fakes.add("p")
    bad, good = fakes.add("bad", Behaviour(fail_next=[failure])), fakes.add("good")
    proxy = make_proxy(prefill=[p.url], decode=[bad.url, good.url], routing={"decode": "round_robin"})
    with proxy.client() as c:
        r = c.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert r.status_code == 200
    assert "good" in r.text
    assert len(bad.requests) == 1 and len(good.requests) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_decode_silent_past_first_byte_timeout_is_retried_elsewhere(fakes, make_proxy, stream):
    p = fakes.add("p")
    slow, good = fakes.add("slow", Behaviour(fail_next=["hang"])), fakes.add("good")
    proxy = make_proxy(
        prefill=[p.url],
        decode=[slow.url, good.url],
        routing={"decode": "round_robin"},
        timeouts={"first_byte_s": 0.5},
    )
    started = time.monotonic()
    with proxy.client() as c:
        r = c.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert r.status_code == 200 and "good" in r.text
    assert time.monotonic() - started < 5
    assert len(slow.requests) == 1 and len(good.requests) == 1
    deadline = time.monotonic() + 5
    while slow.cancelled == 0 and time.monotonic() < deadline:  # the abandoned request is aborted
        time.sleep(0.05)
    assert slow.cancelled == 1


def test_decode_dying_mid_stream_ends_with_an_error_event(fakes, make_proxy):
    p = fakes.add("p")
    d = fakes.add("d", Behaviour(fail_next=["mid_stream"]))
    proxy = make_proxy(prefill=[p.url], decode=[d.url])
    with proxy.client() as c:
        r = c.post("/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 8})
    events = sse_events(r.text)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == [" t0", " t1"]
    assert json.loads(events[-2])["error"]["code"] == 502
    assert events[-1] == "[DONE]"


def test_consecutive_failures_eject_then_health_brings_back(fakes, make_proxy):
    flaky = fakes.add("flaky", Behaviour(fail_next=["500"] * 3))
    steady = fakes.add("steady")
    proxy = make_proxy(
        mode="mixed",
        decode=[flaky.url, steady.url],
        routing={"decode": "round_robin"},
        health={"interval_s": 30, "eject_after": 2, "backoff_s": 0.5},
        retries=1,
    )
    with proxy.client() as c:
        for _ in range(4):
            assert c.post("/v1/completions", json=COMPLETION).status_code == 200
        served_before = len(flaky.requests)
        for _ in range(4):
            assert c.post("/v1/completions", json=COMPLETION).json()["served_by"] == "steady"
        assert len(flaky.requests) == served_before  # ejected: no traffic
        time.sleep(0.6)  # backoff over
        for _ in range(4):
            c.post("/v1/completions", json=COMPLETION)
    assert len(flaky.requests) > served_before


def test_a_request_waits_for_a_restarting_engine_instead_of_bouncing(fakes, make_proxy):
    """While a pool has no backend, a request waits up to ``timeouts.queue_s`` and is served the
    moment a health check finds one back, rather than a 503 that costs the client a retry."""
    d = fakes.add("d")
    proxy = make_proxy(mode="mixed", decode=[d.url], health={"interval_s": 0.2}, timeouts={"queue_s": 10})
    with proxy.client() as c:
        d.behaviour.healthy = False
        wait_until(lambda: not proxy.proxy.ready())
        threading.Timer(1.0, lambda: setattr(d.behaviour, "healthy", True)).start()
        started = time.monotonic()
        r = c.post("/v1/completions", json=COMPLETION)
        waited = time.monotonic() - started
    assert r.status_code == 200 and r.json()["served_by"] == "d"
    assert 0.8 < waited < 3  # back after 1 s, found within a check interval


UNSERVED = 'ucm_proxy_unserved_requests_total{role="decode"}'


def test_a_request_waits_no_longer_than_queue_s(fakes, make_proxy):
    d = fakes.add("d")
    proxy = make_proxy(mode="mixed", decode=[d.url], health={"interval_s": 0.2}, timeouts={"queue_s": 0.5})
    with proxy.client() as c:
        d.behaviour.healthy = False
        wait_until(lambda: not proxy.proxy.ready())
        text = c.get("/metrics").text
        assert UNSERVED + " " in text  # at 0 before any: increase() cannot see a series' first sample
        unserved = series(text, UNSERVED)  # the counter is the process's: other tests count too
        started = time.monotonic()
        r = c.post("/v1/completions", json=COMPLETION)
        waited = time.monotonic() - started
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert 0.4 < waited < 2
        assert 'ucm_proxy_waiting_requests{role="decode"} 0.0' in c.get("/metrics").text
        # ... and counted, for what wakes a pool scaled to zero (a gauge back at 0 shows nothing).
        assert series(c.get("/metrics").text, UNSERVED) == unserved + 1
    assert d.requests == []


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_ready_reflects_backend_health(fakes, make_proxy):
    p, d = fakes.add("p"), fakes.add("d")
    proxy = make_proxy(prefill=[p.url], decode=[d.url])
    with proxy.client() as c:
        assert c.get("/ready").status_code == 200
        d.behaviour.healthy = False
        time.sleep(0.6)
        r = c.get("/ready")
        assert r.status_code == 503 and "error" in r.json()
        assert c.get("/health").status_code == 200  # liveness is the proxy itself
        d.behaviour.healthy = True
        time.sleep(0.6)
        assert c.get("/ready").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_upstream(fakes, make_proxy, stream):
    p = fakes.add("p")
    hanging = fakes.add("d", Behaviour(fail_next=["hang"]))
    proxy = make_proxy(prefill=[p.url], decode=[hanging.url])
    with proxy.client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={**COMPLETION, "stream": stream})
    deadline = time.monotonic() + 5
    while hanging.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hanging.cancelled == 1
    backend = proxy.proxy.decode.backends[0]
    while backend.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.in_flight == 0  # nothing leaked when the stream never started


def test_an_ejection_lasts_its_backoff_through_passing_health_checks(fakes, make_proxy):
    """/health answers but requests fail: the backend stays out for its whole backoff, and the
    next ejection is twice as long."""
    flaky = fakes.add("flaky", Behaviour(fail_next=["500"] * 100))
    steady = fakes.add("steady")
    proxy = make_proxy(
        mode="mixed",
        decode=[flaky.url, steady.url],
        routing={"decode": "round_robin"},
        health={"interval_s": 0.05, "eject_after": 1, "backoff_s": 1.0},
        retries=1,
    )

    def traffic_to_flaky(seconds: float) -> int:
        before, end = len(flaky.requests), time.monotonic() + seconds
        while time.monotonic() < end:
            assert c.post("/v1/completions", json=COMPLETION).status_code == 200
            time.sleep(0.02)
        return len(flaky.requests) - before

    with proxy.client() as c:
        traffic_to_flaky(0.2)  # meets flaky once: ejected for 1 s
        assert traffic_to_flaky(0.7) == 0  # while 14 health checks pass
        time.sleep(0.4)
        assert traffic_to_flaky(0.5) == 1  # back after 1 s, fails once more: ejected for 2 s
        assert traffic_to_flaky(1.3) == 0


def test_a_long_whole_answer_is_not_retried_on_another_decode(fakes, make_proxy):
    slow = fakes.add("slow", Behaviour(delay_s=1.0))
    other = fakes.add("other")
    proxy = make_proxy(
        mode="mixed", decode=[slow.url, other.url], routing={"decode": "round_robin"}, timeouts={"idle_s": 0.3}
    )
    with proxy.client() as c:
        r = c.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.json()["served_by"] == "slow"
    assert len(other.requests) == 0  # generated once, not twice


def test_departed_backends_leave_the_metrics():
    from ucm_proxy import metrics
    from ucm_proxy.backends import Pool
    from ucm_proxy.config import HealthConfig, RoutingConfig

    pool = Pool("decode", ["http://a:1", "http://b:1"], "round_robin", RoutingConfig(), HealthConfig())
    departed = pool.backends[0]
    departed.in_flight_gauge.inc()  # a request still in flight when its backend leaves
    pool.set_urls(["http://b:1"])
    departed.in_flight_gauge.dec()  # ...ends later: its series does not come back
    for metric in (metrics.BACKEND_HEALTHY, metrics.IN_FLIGHT):
        series = {s.labels["backend"] for m in metric.collect() for s in m.samples}
        assert "http://b:1" in series and "http://a:1" not in series


def test_client_disconnect_mid_stream_cancels_upstream(fakes, make_proxy):
    p = fakes.add("p")
    d = fakes.add("d", Behaviour(chunks=50, chunk_delay_s=0.1))
    proxy = make_proxy(prefill=[p.url], decode=[d.url])
    with (
        proxy.client() as c,
        c.stream("POST", "/v1/completions", json={**COMPLETION, "max_tokens": 50, "stream": True}) as r,
    ):
        next(r.iter_bytes())
    deadline = time.monotonic() + 5
    while d.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.cancelled == 1


def test_models_health_and_metrics(pd):
    proxy, _, _ = pd
    with proxy.client() as c:
        deadline = time.monotonic() + 10
        while not c.get("/v1/models").json()["data"] and time.monotonic() < deadline:
            time.sleep(0.05)  # learned by the health checks
        assert c.get("/v1/models").json()["data"] == [{"id": MODEL, "object": "model", "owned_by": "ucm"}]
        assert c.get("/health").json() == {"status": "ok"}
        c.post("/v1/completions", json=COMPLETION)
        c.post("/v1/completions", content=b"{nope")
        text = c.get("/metrics").text
    assert 'ucm_proxy_requests_total{path="pd",route="/v1/completions",status="200"}' in text
    assert 'ucm_proxy_requests_total{path="none",route="/v1/completions",status="400"}' in text
    assert "ucm_proxy_time_to_first_byte_seconds_bucket" in text
    assert "ucm_proxy_backend_healthy" in text
    assert c.__class__ is httpx.Client


def test_no_api_description_and_models_need_a_key_and_cost_no_backend_calls(fakes, make_proxy, tmp_path):
    d = fakes.add("d")
    proxy = make_proxy(mode="mixed", decode=[d.url], api_keys=["k"], health={"interval_s": 60})
    with proxy.client() as c:
        assert c.get("/openapi.json").status_code == 404 and c.get("/docs").status_code == 404
        assert c.get("/v1/models").status_code == 401
        time.sleep(0.3)  # the start's health round is over
        before = d.probes
        assert before > 0
        for _ in range(20):  # each used to set off a round of requests to every backend
            assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert d.probes == before


def test_over_the_in_flight_limit_requests_get_429_with_retry_after(fakes, make_proxy):
    slow = fakes.add("slow", Behaviour(delay_s=1.0))
    proxy = make_proxy(mode="mixed", decode=[slow.url], max_in_flight=2)

    def call():
        with proxy.client() as c:
            return c.post("/v1/completions", json=COMPLETION)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: call(), range(4)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200, 200, 429, 429]
    busy = next(r for r in answers if r.status_code == 429)
    assert busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == 429
    assert call().status_code == 200  # capacity is given back


def test_a_stalled_upload_is_cut_off(fakes, make_proxy):
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], timeouts={"body_s": 0.5})
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )  # one byte of a hundred, then nothing
        started = time.monotonic()
        reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 3
        assert b"connection: close" in reply and s.recv(4096) == b""  # the rest of the body is not awaited


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-"],
    ids=["nothing", "half-the-headers"],
)
def test_a_client_that_does_not_finish_its_headers_is_cut_off(fakes, make_proxy, sent):
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], timeouts={"header_s": 0.5})
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        started = time.monotonic()
        s.sendall(sent)
        reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and b"request headers not received in time" in reply
        assert 0.4 < time.monotonic() - started < 3
        assert s.recv(4096) == b""  # closed


def test_the_header_deadline_does_not_cut_kept_alive_requests(fakes, make_proxy):
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], timeouts={"header_s": 0.5})
    with proxy.client() as c:
        for _ in range(3):
            assert c.post("/v1/completions", json=COMPLETION).status_code == 200
            time.sleep(0.8)  # idle longer than header_s between requests: only a started request is timed


def test_request_bodies_held_at_once_are_bounded(fakes, make_proxy):
    slow = fakes.add("slow", Behaviour(delay_s=1.0))
    # One client here: its share is the whole budget (test_limits holds a client to its share).
    options = {"max_body_bytes": 1000, "max_in_flight_bytes": 2000, "max_client_bytes": 2000}
    proxy = make_proxy(mode="mixed", decode=[slow.url], **options)
    big = {**COMPLETION, "prompt": "x" * 800}  # ~850 bytes: two fit, a third waits for room

    def call(body):
        with proxy.client() as c:
            return c.post("/v1/completions", json=body)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        codes = sorted(r.status_code for r in pool.map(call, [big] * 3))
    assert codes == [200, 200, 429]
    assert call(big).status_code == 200  # given back when they end


def test_a_body_limit_above_the_in_flight_limit_is_refused():
    with pytest.raises(ConfigError, match="max_in_flight_bytes: 100 is below max_body_bytes"):
        parse_config(ProxyConfig, {"mode": "mixed", "decode": ["http://d:1"], "max_in_flight_bytes": 100}, "proxy")


def test_a_backend_that_comes_back_is_seen_within_the_unhealthy_interval(fakes, make_proxy):
    d = fakes.add("d", Behaviour(healthy=False))
    proxy = make_proxy(mode="mixed", decode=[d.url], health={"interval_s": 30, "unhealthy_interval_s": 0.2})
    backend = proxy.proxy.decode.backends[0]
    deadline = time.monotonic() + 10
    while backend.healthy and time.monotonic() < deadline:
        time.sleep(0.05)  # the first round finds it down
    assert not backend.healthy
    d.behaviour.healthy = True  # restarted
    back = time.monotonic()
    while not backend.healthy and time.monotonic() - back < 10:
        time.sleep(0.05)
    assert backend.healthy and time.monotonic() - back < 2  # not the 30 s interval


def test_backends_follow_a_backends_file_replaced_whole(fakes, make_proxy, tmp_path):
    """ucm up rolls a pool by rewriting the file: a new engine joins before the old one leaves."""
    old, new, p = fakes.add("old"), fakes.add("new"), fakes.add("p")
    path = tmp_path / "backends.json"

    def write(decode: list[str]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"prefill": [p.url], "decode": decode}))
        tmp.replace(path)

    write([old.url])
    proxy = make_proxy(backends_file=str(path), routing={"decode": "round_robin"})
    with proxy.client() as c:
        assert "old" in c.post("/v1/completions", json=COMPLETION).text
        write([old.url, new.url])
        deadline = time.monotonic() + 5
        while len(proxy.proxy.decode.backends) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        served = {c.post("/v1/completions", json=COMPLETION).json()["served_by"] for _ in range(4)}
        assert served == {"old", "new"}
        path.write_text("{not json")  # a half-written file (no rename) changes nothing
        write([new.url])
        deadline = time.monotonic() + 5
        while len(proxy.proxy.decode.backends) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {c.post("/v1/completions", json=COMPLETION).json()["served_by"] for _ in range(3)} == {"new"}


def test_a_backends_file_is_one_source_and_must_be_readable(tmp_path):
    with pytest.raises(ConfigError, match="backends_file: cannot read"):
        parse_config(ProxyConfig, {"backends_file": str(tmp_path / "none.json")}, "proxy")
    (tmp_path / "b.json").write_text('{"prefill": [], "decode": ["ftp://x"]}')
    with pytest.raises(ConfigError, match="decode: 'ftp://x' is not an http"):
        parse_config(ProxyConfig, {"backends_file": str(tmp_path / "b.json")}, "proxy")
    (tmp_path / "b.json").write_text('{"prefill": [], "decode": ["http://d"]}')
    with pytest.raises(ConfigError, match="prefill/decode and backends_file: give one source of backends"):
        parse_config(ProxyConfig, {"backends_file": str(tmp_path / "b.json"), "decode": ["http://d"]}, "proxy")
