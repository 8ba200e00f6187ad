"""The KV index: engines' block events in, per-engine cached prefixes of a prompt out."""

from __future__ import annotations

import msgspec
import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from ucm_proxy import metrics
from ucm_proxy.backends import Pool
from ucm_proxy.config import HealthConfig, KVEventsConfig, ProxyConfig, RoutingConfig
from ucm_proxy.kvevents import Followers
from ucm_proxy.kvindex import (
    AllBlocksCleared,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    request_keys,
)
from ucm_proxy.kvroute import KVRouter

BS = 4
PROMPT = list(range(100, 118))  # 4 full blocks and 2 tokens


def stored(hashes, parent, tokens, salt=None, lora=None) -> BlockStored:
    """Blocks as vLLM announces them: the adapter's name first in every block's extra keys, the
    salt after it in the first block's only."""
    extra = [[k for k in (lora, salt if parent is None and i == 0 else None) if k] or None for i in range(len(hashes))]
    return BlockStored(hashes, parent, tokens, BS, "GPU", extra, lora_name=lora)


def batch(*events) -> EventBatch:
    return EventBatch(0.0, list(events))


def hits(index: BlockIndex, url: str, tokens=PROMPT, salt=None, lora=None) -> int:
    """Prompt tokens the engine's own cache holds."""
    return index.cached([url], tokens, salt, lora).get(url, (0, 0))[0]


def test_a_prompts_blocks_match_what_the_engine_announced():
    index = BlockIndex(1000)
    # vLLM's hashes are opaque here; parents link the chain across events.
    index.apply("http://a", batch(stored([b"h1", b"h2"], None, PROMPT[:8])))
    assert hits(index, "http://a") == 8
    index.apply("http://a", batch(stored([b"h3"], b"h2", PROMPT[8:12])))
    assert hits(index, "http://a") == 12
    assert hits(index, "http://a", PROMPT[:5] + [0] * 13) == 4  # diverges in the second block
    assert hits(index, "http://a", [7, *PROMPT[1:]]) == 0


def test_the_cache_salt_separates_tenants():
    index = BlockIndex(1000)
    index.apply("http://a", batch(stored([b"s1", b"s2"], None, PROMPT[:8], salt="tenant-a")))
    assert hits(index, "http://a", salt="tenant-a") == 8
    assert hits(index, "http://a", salt="tenant-b") == 0
    assert hits(index, "http://a") == 0
    assert request_keys(PROMPT, BS, "tenant-a")[1:] != request_keys(PROMPT, BS, None)[1:]  # the chain differs on


def test_adapters_and_the_base_model_never_match_each_others_blocks():
    index = BlockIndex(1000)
    index.apply("http://base", batch(stored([b"b1", b"b2"], None, PROMPT[:8])))
    index.apply("http://ad", batch(stored([b"a1", b"a2"], None, PROMPT[:8], lora="ad")))
    index.apply("http://other", batch(stored([b"o1", b"o2"], None, PROMPT[:8], lora="other")))
    held = {
        lora: {url: hits(index, url, lora=lora) for url in ("http://base", "http://ad", "http://other")}
        for lora in (None, "ad", "other")
    }
    assert held == {
        None: {"http://base": 8, "http://ad": 0, "http://other": 0},
        "ad": {"http://base": 0, "http://ad": 8, "http://other": 0},
        "other": {"http://base": 0, "http://ad": 0, "http://other": 8},
    }


def test_an_adapters_blocks_still_keep_tenants_apart():
    index = BlockIndex(1000)
    index.apply("http://a", batch(stored([b"s1", b"s2"], None, PROMPT[:8], salt="tenant-a", lora="ad")))
    assert hits(index, "http://a", salt="tenant-a", lora="ad") == 8
    assert hits(index, "http://a", salt="tenant-b", lora="ad") == 0
    assert hits(index, "http://a", lora="ad") == 0
    assert hits(index, "http://a", salt="tenant-a") == 0  # the tenant's own prompt on the base model


def test_a_base_prompt_salted_with_an_adapters_name_is_not_that_adapters():
    """vLLM's event extra keys are untagged: ["ad"] is adapter ad's first block, or a base block
    under cache_salt "ad"."""
    index = BlockIndex(1000)
    index.apply("http://a", batch(stored([b"a1", b"a2"], None, PROMPT[:8], lora="ad")))
    index.apply("http://b", batch(stored([b"b1", b"b2"], None, PROMPT[:8], salt="ad")))
    assert hits(index, "http://a", salt="ad") == 0 and hits(index, "http://a", lora="ad") == 8
    assert hits(index, "http://b", lora="ad") == 0 and hits(index, "http://b", salt="ad") == 8


def test_request_keys_differ_per_adapter_and_salt_on_every_block():
    variants = [(None, None), ("ad", None), ("other", None), (None, "s"), ("ad", "s"), ("ad", "t")]
    keys = [request_keys(PROMPT, BS, salt, lora) for lora, salt in variants]
    for block in range(len(PROMPT) // BS):
        assert len({k[block] for k in keys}) == len(variants)


def vllm_announced(tokens, lora: str | None, salt: str | None) -> EventBatch:
    """What vLLM's own block pool announces when it caches a request's full blocks, off the wire."""
    init_none_hash(sha256)
    adapter = LoRARequest(lora, 1, f"/adapters/{lora}") if lora else None
    request = Request(
        "r",
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        lora_request=adapter,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BS, sha256),
    )
    n = len(tokens) // BS
    pool = BlockPool(n + 1, True, BS, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(n), 0, n, BS, 0)
    return decode_batch(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=pool.take_events())))


@pytest.mark.parametrize(("lora", "salt"), [("ad", None), ("ad", "tenant-a"), (None, "tenant-a"), (None, None)])
def test_a_request_matches_what_vllm_announced_for_its_adapter_and_salt_only(lora, salt):
    index = BlockIndex(1000)
    index.apply("http://a", vllm_announced(PROMPT, lora, salt))
    assert hits(index, "http://a", salt=salt, lora=lora) == 16
    others = [(other_lora, other_salt) for other_lora in (None, "ad", "bd") for other_salt in (None, "tenant-a")]
    assert [hits(index, "http://a", salt=s, lora=lo) for lo, s in others if (lo, s) != (lora, salt)] == [0] * 5


def test_removals_and_clears_are_reflected():
    index = BlockIndex(1000)
    index.apply("http://a", batch(stored([b"h1", b"h2", b"h3"], None, PROMPT[:12])))
    index.apply("http://a", batch(BlockRemoved([b"h2"], "GPU")))
    assert hits(index, "http://a") == 4  # the prefix stops where a block is gone
    index.apply("http://a", batch(BlockRemoved([b"h1"], "CPU")))  # another tier's removal: not the engine's cache
    assert hits(index, "http://a") == 4
    index.apply("http://a", batch(AllBlocksCleared()))
    assert len(index.engine("http://a")) == 0 and index.cached(["http://a"], PROMPT, None) == {}


def test_orphans_other_tiers_and_malformed_events_add_nothing():
    index = BlockIndex(1000)
    before = {k: metrics.child(metrics.KV_EVENTS, k)._value.get() for k in ("orphan", "malformed", "other_tier")}
    index.apply("http://a", batch(stored([b"h2"], b"never-seen", PROMPT[4:8])))
    index.apply("http://a", batch(stored([b"h1", b"h2"], None, PROMPT[:7])))  # 7 tokens for 2 blocks
    index.apply("http://a", batch(BlockStored([b"h1"], None, PROMPT[:4], BS, "CPU")))  # vLLM's CPU offload tier
    index.apply("http://a", batch(BlockStored([b"h1"], None, PROMPT[:4], BS, "GPU", None, group_idx=1)))
    assert len(index.engine("http://a")) == 0
    after = {k: metrics.child(metrics.KV_EVENTS, k)._value.get() for k in before}
    assert after == {
        "orphan": before["orphan"] + 1,
        "malformed": before["malformed"] + 1,
        "other_tier": 2 + before["other_tier"],
    }


def test_an_engines_entries_are_bounded_oldest_first():
    index = BlockIndex(3)
    index.apply("http://a", batch(stored([b"h1", b"h2"], None, PROMPT[:8])))
    index.apply("http://a", batch(stored([b"h3", b"h4"], b"h2", PROMPT[8:16])))
    assert len(index.engine("http://a")) == 3
    assert hits(index, "http://a") == 0  # the first block went first: no prefix left
    index.apply("http://a", batch(stored([b"h1"], None, PROMPT[:4])))  # announced again (reused): the newest now
    assert hits(index, "http://a") == 4


def pool(policy: str = "kv_aware", **routing) -> Pool:
    config = RoutingConfig(prefill=policy, kv_events={"port": 5557}, **routing)
    return Pool("prefill", ["http://a", "http://b", "http://c"], policy, config, HealthConfig())


def test_kv_aware_takes_the_engine_holding_the_prefix_unless_its_load_outweighs_it():
    p = pool(kv_aware_load_tokens=256)
    a, b, c = p.backends
    assert p.pick(hits={"http://b": 1024}) is b
    b.in_flight = 3  # 1024 - 3*256 = 256 > 0: still b
    a.in_flight = c.in_flight = 2
    assert p.pick(hits={"http://b": 1024}) is b
    b.in_flight = 7  # over load_factor x the average: not b, whatever it holds
    assert p.pick(hits={"http://b": 1024}) is not b
    b.in_flight = 2
    assert p.pick(hits={"http://b": 0, "http://c": 0}) is a  # all equal, nothing cached: the first least loaded


def test_kv_aware_with_nothing_cached_is_least_outstanding():
    p = pool()
    a, b, c = p.backends
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 1
    assert p.pick(hits=None) is b
    assert p.pick(hits={"http://a": 0}) is b


def test_kv_aware_needs_events_and_events_make_it_the_default():
    assert RoutingConfig(kv_events={"port": 5557}).prefill == "kv_aware"
    assert RoutingConfig(kv_events={"port": 5557}, prefill="least_outstanding").prefill == "least_outstanding"
    with pytest.raises(ValueError, match=r"routing\.prefill: kv_aware needs routing\.kv_events"):
        RoutingConfig(prefill="kv_aware")


@pytest.mark.parametrize(
    ("kv_events", "message"),
    [
        ({}, "give port .* one of them"),
        ({"port": 5557, "endpoints": {"http://a:8000": {"events": "tcp://a:5557"}}}, "one of them"),
        ({"endpoints": {"http://a:8000": {"events": "http://a:5557"}}}, "not a tcp://HOST:PORT or ipc://PATH endpoint"),
        ({"endpoints": {"http://a:8000": {"events": "tcp://a"}}}, "not a tcp://HOST:PORT or ipc://PATH endpoint"),
        ({"endpoints": {"a:8000": {"events": "tcp://a:1"}}}, "not an http"),
        ({"port": 70000}, "less than or equal to 65535"),
        ({"replay_port": 5558, "endpoints": {"http://a:8000": {"events": "tcp://a:1"}}}, "replay_port: needs port"),
    ],
)
def test_event_endpoints_are_checked(kv_events, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(kv_events=kv_events)


def test_a_backends_publisher_is_on_its_host():
    config = RoutingConfig(kv_events={"port": 5557, "replay_port": 5558}).kv_events
    assert config.endpoint("http://10.0.0.7:8000").model_dump() == {
        "events": "tcp://10.0.0.7:5557",
        "replay": "tcp://10.0.0.7:5558",
    }
    assert config.endpoint("http://[fd00::7]:8000").events == "tcp://[fd00::7]:5557"


def test_with_events_the_pool_that_computes_prompts_is_kv_aware():
    pd = ProxyConfig(prefill=["http://p:8000"], decode=["http://d:8000"], routing={"kv_events": {"port": 5557}})
    assert (pd.routing.prefill, pd.routing.decode) == ("kv_aware", "least_outstanding")
    mixed = ProxyConfig(mode="mixed", decode=["http://d:8000"], routing={"kv_events": {"port": 5557}})
    assert mixed.routing.decode == "kv_aware"


def test_the_store_tier_is_shared_by_every_engine_and_weighed_as_a_load():
    index = BlockIndex(1000)
    # Engine a's connector announces what the store holds, under the store's own block ids.
    index.apply("http://a", batch(BlockStored([b"s1", b"s2", b"s3"], None, PROMPT[:12], BS, "STORAGE")))
    index.apply("http://b", batch(stored([b"h1"], None, PROMPT[:4])))  # b's own cache: the first block
    assert index.cached(["http://a", "http://b", "http://c"], PROMPT, None) == {
        "http://a": (0, 12),  # nothing of its own; three blocks to load
        "http://b": (4, 12),
        "http://c": (0, 12),  # an engine that announced nothing still loads from the store
    }
    index.apply("http://b", batch(BlockRemoved([b"s2"], "STORAGE")))  # a lookup found it gone
    assert index.cached(["http://c"], PROMPT, None) == {"http://c": (0, 4)}
    index.apply("http://a", batch(AllBlocksCleared()))  # an engine's own cache: the store keeps its blocks
    assert index.cached(["http://c"], PROMPT, None) == {"http://c": (0, 4)}


@pytest.mark.asyncio
async def test_kv_aware_scores_count_store_tokens_at_their_weight():
    followers = Followers(KVEventsConfig(port=5557))
    followers.index.apply("http://a", batch(BlockStored([b"s1", b"s2", b"s3"], None, PROMPT[:12], BS, "STORAGE")))
    followers.index.apply("http://b", batch(stored([b"h1"], None, PROMPT[:4])))
    router = KVRouter(followers, None, timeout_s=1, store_weight=0.25)  # token ids: no /tokenize call
    scores = await router.hits(pool(), "/v1/completions", {"prompt": PROMPT})
    assert scores == {"http://a": 3.0, "http://b": 4 + 2.0, "http://c": 3.0}  # 12 tokens stored
    assert pool().pick(hits=scores).url == "http://b"


@pytest.mark.asyncio
async def test_kv_aware_scores_an_adapters_request_by_its_adapters_blocks():
    followers = Followers(KVEventsConfig(port=5557))
    followers.index.apply("http://a", batch(stored([b"h1", b"h2", b"h3"], None, PROMPT[:12])))
    followers.index.apply("http://b", batch(stored([b"h1"], None, PROMPT[:4], lora="ad")))
    router = KVRouter(followers, None, timeout_s=1, store_weight=0.5)
    body = {"model": "ad", "prompt": PROMPT}
    assert await router.hits(pool(), "/v1/completions", body, "ad") == {"http://a": 0, "http://b": 4}
    base = {"model": "base", "prompt": PROMPT}
    assert await router.hits(pool(), "/v1/completions", base, None) == {"http://a": 12, "http://b": 0}


@pytest.mark.asyncio
async def test_kv_aware_with_no_backend_available_knows_nothing():
    followers = Followers(KVEventsConfig(port=5557))
    followers.index.apply("http://a", batch(stored([b"h1"], None, PROMPT[:4])))
    p = pool()
    for b in p.backends:
        b.healthy = False
    assert await KVRouter(followers, None, timeout_s=1, store_weight=0.5).hits(p, "/v1/completions", {}) is None
