"""Routing on what engines report, and prefix affinity with bounded load."""

import time

from ucm_proxy.backends import Pool, engine_figures
from ucm_proxy.config import HealthConfig, RoutingConfig
from ucm_testing.fake_vllm import MODEL, Behaviour

COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 2}
VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
"""


def pool(policy: str, n: int, **routing) -> Pool:
    return Pool("decode", [f"http://e{i}:8000" for i in range(n)], policy, RoutingConfig(**routing), HealthConfig())


def test_engine_figures_sum_running_and_waiting_over_engines():
    assert engine_figures(VLLM_METRICS) == (9.0, 0.5)
    assert engine_figures("ucm_proxy_requests_total 3\n") == (None, 0.0)  # not an engine: no figures


def test_least_outstanding_weighs_what_engines_report_and_what_was_sent_since():
    p = pool("least_outstanding", 2)
    a, b = p.backends
    a.read_engine(10.0)  # another proxy's requests: this one has none in flight there
    b.read_engine(2.0)
    assert p.pick() is b
    b.in_flight = 9  # this proxy sent b nine since the reading: 2 + 9 > 10
    assert p.pick() is a
    a.read_engine(None)  # a's metrics could not be read: its load is this proxy's own count (0)
    assert p.pick() is a
    b.in_flight, a.in_flight = 0, 0
    a.read_engine(1.0, kv_usage=0.9)
    b.read_engine(1.0, kv_usage=0.1)
    assert p.pick() is b  # equal load: the emptier KV cache


def test_prefix_affinity_keeps_a_prefix_until_its_owner_is_over_the_bound():
    p = pool("prefix_affinity", 4, load_factor=1.25)
    owner = p.pick(b"conversation 7")
    assert all(p.pick(b"conversation 7") is owner for _ in range(10))
    for b in p.backends:
        b.read_engine(4.0)
    assert p.pick(b"conversation 7") is owner  # everyone equally busy: the owner keeps it
    owner.read_engine(12.0)  # far above the average: the prefix's next backend takes it
    second = p.pick(b"conversation 7")
    assert second is not owner
    p.backends.remove(owner)  # ... the same one that takes it when the owner leaves
    assert p.pick(b"conversation 7") is second


def test_prefix_affinity_moves_few_prefixes_when_the_pool_grows():
    small, large = pool("prefix_affinity", 3), pool("prefix_affinity", 4)
    keys = [f"prefix {i}".encode() for i in range(2000)]
    moved = sum(small.pick(k).url != large.pick(k).url for k in keys)
    assert 0.15 < moved / len(keys) < 0.35  # about 1/4: only what the new backend takes


def test_a_proxy_routes_around_load_another_proxy_put_on_an_engine(fakes, make_proxy):
    busy = fakes.add("busy", Behaviour(running=12, waiting=5))
    idle = fakes.add("idle")
    proxy = make_proxy(
        mode="mixed",
        decode=[busy.url, idle.url],
        routing={"decode": "least_outstanding", "engine_metrics_interval_s": 0.1},
    )
    deadline = time.monotonic() + 5
    while proxy.proxy.decode.backends[0].engine_load is None:
        assert time.monotonic() < deadline, "the proxy never read the engines' metrics"
        time.sleep(0.05)
    with proxy.client() as c:
        served = [c.post("/v1/completions", json=COMPLETION).json()["served_by"] for _ in range(5)]
        assert served == ["idle"] * 5  # by its own counts both were empty
        assert f'ucm_proxy_backend_load{{backend="{busy.url}",role="decode"}} 17.0' in c.get("/metrics").text
