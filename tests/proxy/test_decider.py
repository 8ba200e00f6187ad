"""Selective disaggregation: which PD requests go through prefill and which straight to decode."""

import time

import pytest

from ucm_proxy.decider import CHUNK_TOKENS, Decider
from ucm_proxy.requests import affinity_key
from ucm_testing.fake_vllm import MODEL, Behaviour

WORDS = " ".join(f"word{i:04d}" for i in range(2000))  # ~9 chars a word: ~2.2 tokens at 4 chars/token
SPLIT = {"min_prefill_tokens": 256, "chars_per_token": 4.0}


def completion(prompt, **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **kw}


def test_short_prompts_go_straight_to_decode():
    decider = Decider(256, 4.0, 1000, 2.0)
    decision, _ = decider.decide(completion("Hello there, how are you?"), "/v1/completions")
    assert (decision.disaggregate, decision.reason) == (False, "short")
    ids, _ = decider.decide(completion(list(range(255))), "/v1/completions")
    assert (ids.disaggregate, ids.tokens) == (False, 255)  # token ids are counted, not estimated
    cold, _ = decider.decide(completion(list(range(256))), "/v1/completions")
    assert (cold.disaggregate, cold.reason) == (True, "cold")


def test_a_prompt_whose_prefix_was_stored_goes_straight_to_decode():
    decider = Decider(256, 4.0, 1000, 2.0)
    first = WORDS[:4000]  # ~1000 tokens
    decision, chunks = decider.decide(completion(first), "/v1/completions")
    assert decision.disaggregate and decision.stored == 0
    decider.remember(chunks)
    # The next turn: the same prefix and a little more (~60 new tokens): decode loads the rest.
    again, _ = decider.decide(completion(first + WORDS[4000:4240]), "/v1/completions")
    assert (again.disaggregate, again.reason) == (False, "stored")
    assert again.tokens - again.stored < 256 and again.stored % CHUNK_TOKENS == 0
    # Another long prompt with a different start shares nothing.
    other, _ = decider.decide(completion("x" + first), "/v1/completions")
    assert (other.disaggregate, other.stored) == (True, 0)


def test_a_prefix_stored_under_one_cache_salt_is_not_found_under_another():
    """Tenant isolation (the proxy's cache_salt: per_key gives each API key its salt): what one tenant
    served neither changes another's decision nor its routing key, so neither can be probed."""
    decider = Decider(256, 4.0, 1000, 2.0)
    prompt = WORDS[:4000]
    _, chunks = decider.decide(completion(prompt, cache_salt="tenant-a"), "/v1/completions")
    decider.remember(chunks)
    mine, _ = decider.decide(completion(prompt + " more", cache_salt="tenant-a"), "/v1/completions")
    assert (mine.disaggregate, mine.reason) == (False, "stored")
    theirs, _ = decider.decide(completion(prompt + " more", cache_salt="tenant-b"), "/v1/completions")
    unsalted, _ = decider.decide(completion(prompt + " more"), "/v1/completions")
    assert (theirs.reason, theirs.stored) == ("cold", 0) and (unsalted.reason, unsalted.stored) == ("cold", 0)
    keys = {affinity_key(completion(prompt, cache_salt=s), "/v1/completions", 256) for s in ("a", "b", "")}
    assert len(keys) == 3


def test_a_prefix_stored_for_one_model_is_not_found_for_an_adapter_or_another():
    """A LoRA adapter is served under its own model name and computes other KV than its base model:
    what the base model stored neither saves an adapter's request a prefill nor draws its routing."""
    decider = Decider(256, 4.0, 1000, 2.0)
    prompt = WORDS[:4000]
    _, chunks = decider.decide(completion(prompt), "/v1/completions")
    decider.remember(chunks)
    base, _ = decider.decide(completion(prompt + " more"), "/v1/completions")
    assert (base.disaggregate, base.reason) == (False, "stored")
    for adapter in ("ad", "bd"):
        other, _ = decider.decide({**completion(prompt + " more"), "model": adapter}, "/v1/completions")
        assert (other.reason, other.stored) == ("cold", 0)
    keys = {affinity_key({**completion(prompt), "model": m}, "/v1/completions", 256) for m in (MODEL, "ad", "bd")}
    assert len(keys) == 3


def test_chat_messages_are_one_prompt_with_their_boundaries():
    decider = Decider(256, 4.0, 1000, 2.0)
    turn1 = [{"role": "system", "content": WORDS[:3000]}, {"role": "user", "content": "Summarize."}]
    decision, chunks = decider.decide({"model": MODEL, "messages": turn1}, "/v1/chat/completions")
    assert decision.disaggregate
    decider.remember(chunks)
    turn2 = [*turn1, {"role": "assistant", "content": "It lists words."}, {"role": "user", "content": "More?"}]
    again, _ = decider.decide({"model": MODEL, "messages": turn2}, "/v1/chat/completions")
    assert not again.disaggregate and again.reason == "stored"
    moved = [{"role": "user", "content": WORDS[:3000]}, *turn1[1:]]  # same text, another role
    other, _ = decider.decide({"model": MODEL, "messages": moved}, "/v1/chat/completions")
    assert other.disaggregate and other.stored == 0


def test_a_cold_prompt_goes_to_decode_while_prefill_is_the_busier_pool():
    decider = Decider(256, 4.0, 1000, 2.0)
    cold = completion(WORDS[:4000])
    assert decider.decide(cold, "/v1/completions", pools_gap=lambda: 1.0)[0].disaggregate
    decision, _ = decider.decide(cold, "/v1/completions", pools_gap=lambda: 2.0)
    assert (decision.disaggregate, decision.reason) == (False, "balance")
    busy = lambda: 50.0  # noqa: E731
    assert Decider(256, 4.0, 1000, 0.0).decide(cold, "/v1/completions", pools_gap=busy)[0].disaggregate  # off
    assert Decider(0, 4.0, 1000, 2.0).decide(cold, "/v1/completions", pools_gap=busy)[0].disaggregate  # always PD


def test_through_the_proxy_a_burst_spills_to_decode_when_prefill_is_busy(fakes, make_proxy):
    p, d = fakes.add("p", Behaviour(running=1, waiting=3)), fakes.add("d")
    proxy = make_proxy(
        prefill=[p.url],
        decode=[d.url],
        disaggregation=SPLIT,
        routing={"engine_metrics_interval_s": 0.1},
    )
    deadline = time.monotonic() + 5
    while proxy.proxy.prefill.backends[0].engine_load is None:
        assert time.monotonic() < deadline, "the proxy never read the engines' metrics"
        time.sleep(0.05)
    with proxy.client() as c:
        assert c.post("/v1/completions", json=completion(WORDS[:4000])).status_code == 200
        p.behaviour.waiting = 0  # prefill caught up: the next cold prompt goes through it
        deadline = time.monotonic() + 5
        while proxy.proxy.prefill.backends[0].engine_load != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.post("/v1/completions", json=completion("y" + WORDS[:4000])).status_code == 200
        metrics = c.get("/metrics").text
    assert len(p.requests) == 1 and "kv_transfer_params" in d.requests[1]["body"]
    assert 'ucm_proxy_disaggregation_decisions_total{decision="balance"} 1.0' in metrics


def test_with_nothing_remembered_long_prompts_are_disaggregated():
    """A proxy that cannot know what is stored (nothing remembered: a restart, or remembering
    turned off) disaggregates: the safe side, as without selective disaggregation."""
    decider = Decider(256, 4.0, 0, 2.0)
    _, chunks = decider.decide(completion(WORDS[:4000]), "/v1/completions")
    decider.remember(chunks)
    decision, _ = decider.decide(completion(WORDS[:4000]), "/v1/completions")
    assert decision.disaggregate and decision.stored == 0


def test_memory_is_bounded_least_recently_used_first():
    decider = Decider(256, 4.0, 40, 2.0)
    prompts = [f"{i:03d}" + WORDS[:4000] for i in range(3)]  # ~15 chunks each
    for p in prompts:
        decider.remember(decider.decide(completion(p), "/v1/completions")[1])
    assert len(decider._chunks) == 40
    assert decider.decide(completion(prompts[0]), "/v1/completions")[0].disaggregate  # forgotten
    assert not decider.decide(completion(prompts[2]), "/v1/completions")[0].disaggregate


@pytest.mark.parametrize("stream", [False, True])
def test_through_the_proxy_short_stored_and_cold_requests(fakes, make_proxy, stream):
    p, d = fakes.add("p"), fakes.add("d")
    proxy = make_proxy(prefill=[p.url], decode=[d.url], disaggregation=SPLIT)
    long = WORDS[:4000]
    with proxy.client() as c:
        for prompt in ("Hi", long, long + " and one more line"):
            assert c.post("/v1/completions", json=completion(prompt, stream=stream)).status_code == 200
        metrics = c.get("/metrics").text
        report = c.get("/pd-path").json()
    assert [r["body"]["prompt"] for r in p.requests] == [long]  # only the cold one was prefilled
    assert [("kv_transfer_params" in r["body"]) for r in d.requests] == [False, True, False]
    assert report["paths"]["direct"] == 2 and report["paths"]["pd"] == 1
    assert report["effective"]["value"] is True  # requests meant for prefill went through it
    for decision in ("short", "stored", "cold"):
        assert f'ucm_proxy_disaggregation_decisions_total{{decision="{decision}"}}' in metrics


def test_a_failed_request_is_not_remembered_as_stored(fakes, make_proxy):
    p, d = fakes.add("p"), fakes.add("d", Behaviour(fail_next=["500", "500"]))
    proxy = make_proxy(prefill=[p.url], decode=[d.url], retries=0, disaggregation=SPLIT)
    long = WORDS[:4000]
    with proxy.client() as c:
        assert c.post("/v1/completions", json=completion(long)).status_code >= 500
        assert c.post("/v1/completions", json=completion(long)).status_code >= 500
        assert c.post("/v1/completions", json=completion(long)).status_code == 200
    assert len(p.requests) == 3  # each attempt was still cold: nothing stored its prefix
