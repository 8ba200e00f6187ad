"""The whole path on one machine: client -> ucm-proxy -> prefill vLLM -> store -> decode vLLM.

Tests run in file order: the failure tests kill engines last."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from e2e.conftest import Stack, kill_role
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer, metric_totals

pytestmark = pytest.mark.slow
BLOCK = 32


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def stream(url: str, body: dict[str, Any]) -> str:
    """The text of a streamed response, from its SSE chunks."""
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def metric(url: str, name: str) -> float:
    return metric_totals(url).get(name, 0.0)


def text_of(response: dict[str, Any]) -> str:
    choice = response["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_pd_through_the_proxy_equals_plain_vllm(stack: Stack, plain: VLLMServer, streaming: bool):
    decode = stack.state()["roles"]["decode-0"]["url"]
    # Fresh prompts per case: a prompt decode has seen is in its own prefix cache, not loaded.
    for i, prompt in enumerate(PROMPTS[2:4] if streaming else PROMPTS[:2]):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 8,
            "temperature": 0,
        }
        loaded_before = metric(decode, "ucm_connector_loaded_blocks_total")
        for path, req in (("/completions", body), ("/chat/completions", chat)):
            status, want = post(plain.url + "/v1" + path, req)
            assert status == 200
            if streaming:
                got = stream(stack.base_url + path, req)
            else:
                status, response = post(stack.base_url + path, req)
                assert status == 200, response
                got = text_of(response)
            assert got == text_of(want), f"prompt {i} {path}"
        loaded = metric(decode, "ucm_connector_loaded_blocks_total") - loaded_before
        # the decode engine computed nothing it could load: every full prompt block came from the store
        assert loaded >= 2 * (len(prompt) // 8 // BLOCK), loaded


def test_multi_turn_chat_reuses_earlier_turns(stack: Stack):
    decode = stack.state()["roles"]["decode-0"]["url"]
    messages = [{"role": "user", "content": PROMPTS[5]}]
    loaded, cached = [], []
    for turn in range(3):
        before = metric(decode, "ucm_connector_loaded_blocks_total")
        status, r = post(
            stack.base_url + "/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 32}
        )
        assert status == 200, r
        loaded.append(metric(decode, "ucm_connector_loaded_blocks_total") - before)
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages += [r["choices"][0]["message"], {"role": "user", "content": PROMPTS[6 + turn][:200]}]
    # Each turn finds the conversation so far already computed (cached tokens grow with it), and
    # decode gets each turn's new blocks from the store (earlier ones are in its own prefix cache).
    assert cached[0] < cached[1] < cached[2], cached
    assert cached[2] >= BLOCK * 6, cached
    assert all(n > 0 for n in loaded), loaded
    # The proxy follows the prefill engine's KV events (ucm up turns them on): its index holds the
    # conversation's blocks, and the later turns' prefill was chosen for them (kv_aware).
    proxy = stack.base_url.removesuffix("/v1")
    assert metric(proxy, "ucm_proxy_kv_index_blocks") >= 6
    assert metric(proxy, "ucm_proxy_kv_predicted_hit_tokens_total") >= BLOCK * 6


def test_the_pd_path_check_sees_decode_load_what_prefill_saved(stack: Stack):
    """The proxy's own check through real engines and the store: a prompt no one sent before,
    prefilled, then decoded with what decode loaded from the store."""
    proxy = stack.base_url.removesuffix("/v1")
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(proxy + "/pd-path", timeout=10) as r:
            report = json.loads(r.read())
        check = report["check"]
        if (check and check["healthy"]) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert check is not None and check["reason"] == "Healthy", report
    assert " tokens loaded" in check["message"]
    # The earlier tests' requests went through prefill, and decode loaded their KV.
    assert report["effective"]["value"] is True, report
    assert metric(proxy, "ucm_proxy_pd_path_healthy") == 1.0
    # Both pools name the same pairing identity on /health (the proxy pairs by it).
    identities = set()
    for role in ("prefill-0", "decode-0"):
        with urllib.request.urlopen(stack.state()["roles"][role]["url"] + "/health", timeout=10) as r:
            identities.add(r.headers["X-UCM-KV-Identity"])
    assert len(identities) == 1 and None not in identities, identities


def test_the_openai_client_works_unchanged(stack: Stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    pieces = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == chat.choices[0].message.content
    completion = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert completion.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=-1)
    assert "max_tokens" in str(err.value)


def test_engines_answer_only_the_proxy(stack: Stack):
    """Any pod could otherwise skip the proxy's keys and limits and set kv_transfer_params itself."""
    decode = stack.state()["roles"]["decode-0"]["url"]
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2}
    status, _ = post(decode + "/v1/completions", body)
    assert status == 401
    key = (stack.run_dir / stack.name / "credentials" / "backend-api-key").read_text().strip()
    req = urllib.request.Request(
        decode + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    status, _ = post(stack.base_url + "/completions", body)  # the proxy holds the key
    assert status == 200


def test_an_engine_whose_store_stays_stuck_serves_on_and_says_so(stack: Stack):
    """The file is what prefill's scheduler writes when a lookup has been stuck since ``since``
    (written here: a real stuck store is shown by the unit test with a held store and by
    benchmarks/fault_serving.py with a stalled FUSE mount); this checks the real engine's /health
    and the proxy act on it: prefill stays in service, saying its store is degraded, and the proxy
    sends requests straight to decode (prefill's KV could not reach it)."""
    roles = stack.state()["roles"]
    prefill, proxy = roles["prefill-0"]["url"], roles["proxy"]["url"]
    marker = stack.run_dir / "prefill-store.json"
    marker.write_text(json.dumps({"since": time.time() - 60, "unhealthy_after_s": 30}))
    try:
        with urllib.request.urlopen(prefill + "/health", timeout=10) as r:
            assert r.status == 200
            assert "the KV store has not answered for 60 s (limit 30 s)" in r.headers["X-UCM-Store"]
        deadline = time.monotonic() + 30
        while metric(proxy, "ucm_proxy_backend_store_degraded") < 1:  # the proxy's next health check
            assert time.monotonic() < deadline, "the proxy did not read prefill's X-UCM-Store"
            time.sleep(0.5)
        before = fallbacks(proxy)
        status, _ = post(stack.base_url + "/completions", {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 4})
        assert status == 200
        assert fallbacks(proxy) == before + 1  # decode computed it: no PD through a store that does not answer
        assert metric(proxy, "ucm_proxy_backend_healthy") == 2  # nobody was taken out of service
    finally:
        marker.unlink()
    wait_served(stack)


def fallbacks(proxy: str) -> float:
    """Requests decode served alone (``path="fallback"``), by the proxy's request counter."""
    with urllib.request.urlopen(proxy + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    series = [x for x in lines if x.startswith("ucm_proxy_requests_total{") and 'path="fallback"' in x]
    return sum(float(x.rpartition(" ")[2]) for x in series)


def wait_served(stack: Stack, timeout: float = 240.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        status, _ = post(stack.base_url + "/completions", {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 4}, 30)
        if status == 200:
            return time.monotonic() - t0
        time.sleep(1.0)
    raise AssertionError(f"not served again within {timeout} s:\n{stack.output()[-3000:]}")


def test_killing_the_decode_engine_gives_clear_errors_then_recovers(stack: Stack):
    proxy = stack.state()["roles"]["proxy"]["url"]
    kill_role(stack, "decode-0")
    time.sleep(0.5)
    status, body = post(stack.base_url + "/completions", {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 4})
    assert status in (502, 503), body
    assert "decode" in body["error"]["message"].lower(), body

    def decode_marked_down() -> bool:
        return metric(proxy, "ucm_proxy_backend_healthy") < 2  # prefill up, decode down

    deadline = time.monotonic() + 30
    while not decode_marked_down() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert decode_marked_down()
    wait_served(stack)  # ucm up restarted it; the proxy's health check brought it back
    assert "decode-0 exited" in stack.output()
    assert stack.state()["roles"]["decode-0"]["restarts"] == 1


def test_killing_the_prefill_engine_falls_back_to_decode(stack: Stack):
    kill_role(stack, "prefill-0")
    time.sleep(0.5)
    status, body = post(stack.base_url + "/completions", {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 8})
    assert status == 200, body  # fallback_to_decode: decode computes the whole request
    wait_served(stack)
