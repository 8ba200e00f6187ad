"""The PD path check and the record of paths requests took (ucm_proxy.pdpath), with fake engines
that save, load or fail on demand; the status write against kmock's API server."""

import asyncio
import time
from types import SimpleNamespace

import aiohttp
import pytest

from ucm_proxy.config import DiscoveryConfig
from ucm_proxy.discovery import write_pd_path
from ucm_proxy.pdpath import PathCheck, RecentPaths, check_prompt
from ucm_testing.fake_vllm import Behaviour

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}
FAST = {"interval_s": 0.2, "timeout_s": 2}


def wait_check(client, want=lambda check: check is not None, timeout_s=10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = client.get("/pd-path").json()
        if want(report["check"]):
            return report
        time.sleep(0.05)
    raise AssertionError(f"no such check within {timeout_s} s: {report}")


def metric(text: str, series: str) -> float:
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(series)), 0.0)


def test_a_healthy_path_passes_through_prefill_store_and_decode_and_is_not_client_traffic(fakes, make_proxy):
    p, d = fakes.add("p"), fakes.add("d")
    proxy = make_proxy(prefill=[p.url], decode=[d.url], pd_check=FAST)
    with proxy.client() as c:
        before = client_requests(c.get("/metrics").text)
        report = wait_check(c, lambda check: check is not None and check["healthy"])
        text = c.get("/metrics").text
    check = report["check"]
    assert check["reason"] == "Healthy" and (check["prefill"], check["decode"]) == (p.url, d.url)
    assert "3 blocks, 48 tokens loaded" in check["message"]
    # prefill was asked to keep the KV; decode got what prefill answered
    assert p.requests[0]["body"]["kv_transfer_params"] == {"do_remote_decode": True}
    assert d.requests[0]["body"]["kv_transfer_params"]["prefilled_by"] == "p"
    assert p.requests[0]["headers"]["X-Request-Id"].startswith("ucm-pd-check-")
    assert metric(text, "ucm_proxy_pd_path_healthy ") == 1.0
    assert client_requests(text) == before  # checks are not client traffic
    assert report["effective"] == {"value": None, "reason": "NoTraffic", "message": "no client requests yet"}


def client_requests(text: str) -> float:
    """Every ucm_proxy_requests_total series summed (the registry is the test process's)."""
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith("ucm_proxy_requests_total{"))


def test_each_check_prompt_is_new():
    a, b = check_prompt(50), check_prompt(50)
    assert a != b and a.split(":")[0] != b.split(":")[0]  # the nonce leads: every block differs
    assert len(a.split()) == 50 + 4


@pytest.mark.parametrize(
    ("prefill", "decode", "reason", "names"),
    [
        (Behaviour(saves=False), Behaviour(), "StoreWritesFailing", "prefill"),
        (Behaviour(), Behaviour(loads=False), "DecodeNotLoading", "decode"),
        (Behaviour(fail_next=["500"] * 100), Behaviour(), "PrefillFailed", "prefill"),
        (Behaviour(), Behaviour(fail_next=["500"] * 100), "DecodeFailed", "decode"),
        (Behaviour(healthy=False), Behaviour(), "NoPrefill", None),
    ],
)
def test_a_broken_hop_is_named(fakes, make_proxy, prefill, decode, reason, names):
    p, d = fakes.add("p", prefill), fakes.add("d", decode)
    proxy = make_proxy(prefill=[p.url], decode=[d.url], pd_check=FAST, fallback_to_decode=True)
    with proxy.client() as c:
        report = wait_check(c, lambda check: check is not None and check["reason"] == reason)
        text = c.get("/metrics").text
    check = report["check"]
    assert check["healthy"] is False
    if names is not None:  # the message names the backend of the broken hop
        assert f"{names} {p.url if names == 'prefill' else d.url}" in check["message"]
    assert metric(text, "ucm_proxy_pd_path_healthy ") == 0.0
    assert metric(text, f'ucm_proxy_pd_path_checks_total{{result="{reason}"}}') >= 1


@pytest.mark.parametrize(("starting", "reason"), [(0, "ScaledToZero"), (1, "NoPrefill")])
def test_a_pool_scaled_to_zero_is_not_a_broken_path(fakes, make_proxy, starting, reason):
    """Discovery finding no pod of a pool at all (autoscaled to zero) leaves nothing to check and must
    not page anyone (UCMPDPathBroken); a pod that exists but is not ready is a broken hop."""
    p, d = fakes.add("p"), fakes.add("d")
    proxy = make_proxy(prefill=[p.url], decode=[d.url], pd_check=FAST, fallback_to_decode=True)
    with proxy.client() as c:
        wait_check(c, lambda check: check is not None and check["healthy"])
        proxy.proxy.prefill.set_urls([], starting=starting)  # what discovery does when the pods go
        report = wait_check(c, lambda check: check is not None and check["reason"] == reason)
        text = c.get("/metrics").text
    assert report["check"]["healthy"] is (reason == "ScaledToZero")
    assert metric(text, "ucm_proxy_pd_path_healthy ") == (1.0 if reason == "ScaledToZero" else 0.0)
    if reason == "ScaledToZero":
        assert "prefill pool has no pods" in report["check"]["message"]


def test_checks_take_backends_in_turn(fakes, make_proxy):
    p = fakes.add("p")
    good, bad = fakes.add("good"), fakes.add("bad", Behaviour(loads=False))
    proxy = make_proxy(prefill=[p.url], decode=[good.url, bad.url], pd_check=FAST)
    with proxy.client() as c:
        report = wait_check(c, lambda check: check is not None and check["reason"] == "DecodeNotLoading")
    assert report["check"]["decode"] == bad.url
    assert good.requests  # it was checked too, and passed


def test_effective_when_requests_go_through_prefill_and_decode_loads_the_kv(fakes, make_proxy):
    p, d = fakes.add("p"), fakes.add("d")
    proxy = make_proxy(prefill=[p.url], decode=[d.url])
    series = 'ucm_proxy_requests_total{path="pd",route="/v1/completions",status="200"}'
    with proxy.client() as c:
        before = metric(c.get("/metrics").text, series)
        for _ in range(4):
            assert c.post("/v1/completions", json=COMPLETION).status_code == 200
        report = c.get("/pd-path").json()
        text = c.get("/metrics").text
    assert report["effective"]["value"] is True and report["effective"]["reason"] == "Disaggregated"
    assert report["paths"] == {"pd": 4, "direct": 0, "fallback": 0, "decode_only": 0}
    assert metric(text, series) == before + 4
    assert report["check"] is None  # the check is off in this test


def test_not_effective_when_decode_recomputes(fakes, make_proxy):
    p, d = fakes.add("p"), fakes.add("d", Behaviour(loads=False))
    proxy = make_proxy(prefill=[p.url], decode=[d.url])
    with proxy.client() as c:
        for _ in range(3):
            c.post("/v1/completions", json=COMPLETION)
        effective = c.get("/pd-path").json()["effective"]
    assert effective["value"] is False and effective["reason"] == "DecodeRecomputing"
    assert "decode loaded the prompt's KV in 0 of the last 3 PD answers" in effective["message"]


def test_not_effective_when_requests_fall_back(fakes, make_proxy):
    p, d = fakes.add("p", Behaviour(healthy=False)), fakes.add("d")
    proxy = make_proxy(prefill=[p.url], decode=[d.url], fallback_to_decode=True)
    with proxy.client() as c:
        wait = time.monotonic() + 5
        while proxy.proxy.prefill.available() and time.monotonic() < wait:
            time.sleep(0.05)  # the first health round takes prefill out
        for _ in range(3):
            assert c.post("/v1/completions", json=COMPLETION).status_code == 200
        report = c.get("/pd-path").json()
    assert report["paths"]["fallback"] == 3
    assert report["effective"]["value"] is False and report["effective"]["reason"] == "NotDisaggregated"


def test_recent_paths_judge_the_last_requests_only():
    recent = RecentPaths(size=4)
    for _ in range(4):
        recent.record("fallback")
    assert recent.effective(None)[0] is False
    for _ in range(4):
        recent.record("pd")
    broken = PathCheck(False, "DecodeNotLoading", "decode x computed the whole prompt", 0.0)
    assert recent.effective(broken)[:2] == (False, "DecodeNotLoading")  # no answers read: the check decides
    recent.record_decode(3, b'{"kv_transfer_params":{"ucm_loaded_tokens":48}}')
    recent.record_decode(0, b'{"kv_transfer_params":{"ucm_loaded_tokens":0}}')  # nothing promised
    recent.record_decode(3, b'{"kv_transfer_params":null}')  # not UCM's connector: no evidence
    assert list(recent.loaded) == [True]
    assert recent.effective(broken)[:2] == (True, "Disaggregated")


@pytest.mark.asyncio
async def test_the_check_is_written_into_the_resource_status(kmock, tmp_path):
    url = str(kmock.url).rstrip("/")
    resource = f"{url}/apis/ucm.io/v1alpha1/namespaces/serving/ucmdeployments"
    async with aiohttp.ClientSession() as http:
        body = {"apiVersion": "ucm.io/v1alpha1", "kind": "UCMDeployment", "metadata": {"name": "chat"}}
        await (await http.post(resource, json={**body, "status": {"conditions": [{"type": "Ready"}]}})).release()
        config = DiscoveryConfig(
            namespace="serving",
            decode_service="chat-decode",
            api_server=url,
            token_path=tmp_path / "no-token",
            ca_path=None,
            resource="chat",
        )
        recent = RecentPaths()
        write = write_pd_path(SimpleNamespace(recent=recent), config)
        await write(PathCheck(False, "DecodeNotLoading", "decode d computed the whole prompt", 1.8e9, "p", "d"))
        status = (await (await http.get(f"{resource}/chat")).json())["status"]
        assert status["pdPath"]["healthy"] is False and status["pdPath"]["reason"] == "DecodeNotLoading"
        assert status["pdPath"]["checkedAt"] == "2027-01-15T08:00:00Z"
        assert status["pdPath"]["effectiveReason"] == "NoTraffic"
        assert status["conditions"] == [{"type": "Ready"}]  # a merge patch: the operator's fields stay
        await (await http.patch(f"{resource}/chat/status", json={"status": {"pdPath": None}})).release()
        await write(PathCheck(False, "DecodeNotLoading", "again", 1.8e9 + 30))  # unchanged: not written
        assert "pdPath" not in (await (await http.get(f"{resource}/chat")).json())["status"]
        recent.record("pd")
        await write(PathCheck(True, "Healthy", "fine", 1.8e9 + 60))
        status = (await (await http.get(f"{resource}/chat")).json())["status"]
        assert status["pdPath"]["healthy"] is True and status["pdPath"]["effective"] is True
    await asyncio.sleep(0)


def wait_identities(proxy, n: int) -> None:
    deadline = time.monotonic() + 5
    while sum(b.identity is not None for p in proxy.proxy.pools for b in p.backends) < n:
        assert time.monotonic() < deadline, "health checks did not report identities"
        time.sleep(0.05)


def test_a_prefill_is_paired_only_with_a_decode_of_its_configuration(fakes, make_proxy):
    """Mid-rollout, old and new engines serve side by side: KV from an old prefill goes to an old
    decode only (a new one could not see its blocks)."""
    old_p, new_p = fakes.add("old-p", Behaviour(identity="v1")), fakes.add("new-p", Behaviour(identity="v2"))
    old_d, new_d = fakes.add("old-d", Behaviour(identity="v1")), fakes.add("new-d", Behaviour(identity="v2"))
    proxy = make_proxy(
        prefill=[old_p.url, new_p.url],
        decode=[old_d.url, new_d.url],
        routing={"prefill": "round_robin", "decode": "round_robin"},
        pd_check=FAST,
    )
    wait_identities(proxy, 4)
    matched = 'ucm_proxy_pd_pairs_total{matched="true"}'
    with proxy.client() as c:
        before = c.get("/metrics").text
        for i in range(8):
            assert c.post("/v1/completions", json={**COMPLETION, "prompt": f"p{i}"}).status_code == 200
        check = wait_check(c, lambda check: check is not None and check["healthy"])["check"]
        after = c.get("/metrics").text
    assert metric(after, matched) - metric(before, matched) == 8
    assert metric(after, 'ucm_proxy_pd_pairs_total{matched="false"}') == 0
    prefilled_by = {
        d.name: {r["body"]["kv_transfer_params"]["prefilled_by"] for r in d.requests} for d in (old_d, new_d)
    }
    assert prefilled_by == {"old-d": {"old-p"}, "new-d": {"new-p"}}
    assert (check["prefill"], check["decode"]) in {(old_p.url, old_d.url), (new_p.url, new_d.url)}


def test_with_no_pair_decode_serves_alone(fakes, make_proxy):
    p, d = fakes.add("p", Behaviour(identity="v1")), fakes.add("d", Behaviour(identity="v2"))
    proxy = make_proxy(prefill=[p.url], decode=[d.url], pd_check=FAST)
    wait_identities(proxy, 2)
    with proxy.client() as c:
        before = len(p.requests)
        r = c.post("/v1/completions", json=COMPLETION)
        check = wait_check(c, lambda check: check is not None and check["reason"] == "Unpaired")["check"]
        paths = c.get("/pd-path").json()["paths"]
    assert r.status_code == 200 and "kv_transfer_params" not in d.requests[-1]["body"]
    assert len(p.requests) == before  # no prefill whose KV decode could not use
    assert paths["fallback"] == 1
    assert "no available decode shares a configuration" in check["message"]


def test_prefills_whose_store_is_degraded_are_skipped_and_with_none_left_decode_serves_alone(fakes, make_proxy):
    """An engine whose KV store does not answer keeps serving (its /health stays 200 and says
    X-UCM-Store: degraded), but a prefill's KV cannot reach decode through that store: PD requests
    go to another prefill, or straight to decode when none is left (they waited out pd_save_wait_s,
    then decode's pd wait, before)."""
    sick, well, d = fakes.add("sick", Behaviour(store_degraded=True)), fakes.add("well"), fakes.add("d")
    proxy = make_proxy(prefill=[sick.url, well.url], decode=[d.url], routing={"prefill": "round_robin"})
    backends = {b.url: b for b in proxy.proxy.prefill.backends}
    wait_for(lambda: backends[sick.url].store_degraded)

    def client_requests(engine) -> int:
        return sum(not r["headers"]["X-Request-Id"].startswith("ucm-pd-check-") for r in engine.requests)

    with proxy.client() as c:
        for i in range(4):
            assert c.post("/v1/completions", json={**COMPLETION, "prompt": f"p{i}"}).status_code == 200
        assert client_requests(sick) == 0 and client_requests(well) == 4
        assert {r["body"]["kv_transfer_params"]["prefilled_by"] for r in d.requests[-4:]} == {"well"}

        well.behaviour.store_degraded = True
        wait_for(lambda: backends[well.url].store_degraded)
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200
        assert client_requests(well) == 4 and "kv_transfer_params" not in d.requests[-1]["body"]
        assert c.get("/pd-path").json()["paths"]["fallback"] == 1

        well.behaviour.store_degraded = False  # its store answers again: PD through it again
        wait_for(lambda: not backends[well.url].store_degraded)
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200
    assert client_requests(well) == 5 and d.requests[-1]["body"]["kv_transfer_params"]["prefilled_by"] == "well"


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the proxy's health checks did not see it"
        time.sleep(0.05)
