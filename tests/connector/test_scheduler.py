"""The scheduler half's decisions, with a real store and request objects shaped like vLLM's."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from ucm.hashing import BlockHasher, HashContext
from ucm.integration.vllm.metadata import rank_keys, store_keys
from ucm.integration.vllm.scheduler import (
    HASHERS_KEPT,
    PARAM_BLEND,
    PARAM_BLOCKS,
    PARAM_CHUNKS,
    PARAM_LOADED,
    SchedulerSide,
)
from ucm.integration.vllm.stats import StatsRecorder
from ucm.store import create_store

BS = 4
CTX = HashContext(model="m", dtype="float32", block_size=BS)


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None = None
    cache_salt: str | None = None
    extra: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.extra)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.extra


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path):
    s = create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}})
    yield s
    s.close()


def side(
    store, *, can_load=True, can_save=True, clock=None, timeout=5.0, tp_size=1, decode_save=0, health=None
) -> SchedulerSide:
    return SchedulerSide(
        CTX,
        store,
        can_load=can_load,
        can_save=can_save,
        pd_wait_timeout_s=timeout,
        stats=StatsRecorder(),
        tp_size=tp_size,
        clock=clock or Clock(),
        decode_save_blocks=decode_save,
        health=health,
    )


def put(store, tokens, n_blocks, salt=""):
    ids = BlockHasher(CTX.for_request(salt)).block_ids(tokens)[:n_blocks]
    store.wait(store.dump(ids, [b"x"] * len(ids)))


def step(new=(), cached=(), resumed=(), scheduled=None):
    """A SchedulerOutput-shaped object."""
    new_reqs = [SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new]
    cached_reqs = SimpleNamespace(
        req_ids=[r for r, _, _ in cached],
        new_block_ids=[(b,) if b else None for _, b, _ in cached],
        num_computed_tokens=[c for _, _, c in cached],
        resumed_req_ids=set(resumed),
    )
    return SimpleNamespace(
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs, num_scheduled_tokens=scheduled or {}
    )


TOKENS = list(range(100, 118))  # 18 tokens: 4 full blocks + 2


def test_loads_beyond_the_local_hit_and_saves_the_rest(store):
    put(store, TOKENS, 3)
    s = side(store)
    req = Req("r", TOKENS)
    assert s.num_new_matched_tokens(req, 4) == (8, False)  # local 1 block, store 3 -> load blocks 1..2
    s.after_alloc(req, [10, 11, 12, 13, 14], 8)
    meta = s.build_meta(step(new=[("r", [10, 11, 12, 13, 14], 12)], scheduled={"r": 6}))
    [load] = meta.loads
    assert load.block_ids == [11, 12]
    assert load.store_ids == BlockHasher(CTX).block_ids(TOKENS)[1:3]
    [save] = meta.saves
    assert save.block_ids == [13]  # block 3 becomes full this step; 4 is partial
    assert s._stats.take().data["external_hit_tokens"] == 8


def test_full_hit_leaves_one_token_to_compute(store):
    tokens = list(range(16))  # exactly 4 blocks
    put(store, tokens, 4)
    s = side(store)
    assert s.num_new_matched_tokens(Req("r", tokens), 0) == (15, False)
    s.after_alloc(Req("r", tokens), [1, 2, 3, 4], 15)
    meta = s.build_meta(step(new=[("r", [1, 2, 3, 4], 15)], scheduled={"r": 1}))
    assert meta.loads[0].block_ids == [1, 2, 3, 4]  # the last block is loaded whole
    assert meta.saves == []


def test_a_request_whose_load_failed_saves_again_from_the_failed_block(store):
    """The workers dropped the step's saves (computed over the failed block); vLLM computes the
    request again from that block, and what it computes is saved, the failed block included."""
    put(store, TOKENS, 3)
    s = side(store)
    req = Req("r", TOKENS)
    assert s.num_new_matched_tokens(req, 4) == (8, False)
    s.after_alloc(req, [10, 11, 12, 13, 14], 8)
    first = s.build_meta(step(new=[("r", [10, 11, 12, 13, 14], 12)], scheduled={"r": 6}))
    assert [t.block_ids for t in first.saves] == [[13]]
    s.loads_failed({12})  # block 2 of the request did not load
    again = s.build_meta(step(cached=[("r", None, 8)], scheduled={"r": 10}))
    assert [t.block_ids for t in again.saves] == [[12, 13]]


def test_no_hit_beyond_local_means_no_load(store):
    put(store, TOKENS, 2)
    s = side(store)
    assert s.num_new_matched_tokens(Req("r", TOKENS), 8) == (0, False)


def test_chunked_prefill_saves_blocks_as_they_fill(store):
    s = side(store)
    req = Req("r", TOKENS)
    assert s.num_new_matched_tokens(req, 0) == (0, False)
    s.after_alloc(req, [5, 6], 0)
    first = s.build_meta(step(new=[("r", [5, 6], 0)], scheduled={"r": 6}))
    assert [t.block_ids for t in first.saves] == [[5]]
    second = s.build_meta(step(cached=[("r", [7, 8, 9], 6)], scheduled={"r": 12}))
    assert [t.block_ids for t in second.saves] == [[6, 7, 8]]
    third = s.build_meta(step(cached=[("r", None, 18)], scheduled={"r": 1}))  # decoding: nothing new
    assert third.saves == []


def test_consumer_never_saves_and_producer_never_loads(store):
    put(store, TOKENS, 4)
    consumer, producer = side(store, can_save=False), side(store, can_load=False)
    req = Req("r", TOKENS)
    assert consumer.num_new_matched_tokens(req, 0)[0] == 16
    consumer.after_alloc(req, [1, 2, 3, 4, 5], 16)
    assert consumer.build_meta(step(new=[("r", [1, 2, 3, 4, 5], 16)], scheduled={"r": 2})).saves == []
    assert producer.num_new_matched_tokens(Req("p", TOKENS), 0) == (0, False)
    other = list(range(500, 512))
    assert producer.num_new_matched_tokens(Req("q", other), 0) == (0, False)
    producer.after_alloc(Req("q", other), [1, 2, 3], 0)
    assert producer.build_meta(step(new=[("q", [1, 2, 3], 0)], scheduled={"q": 12})).saves[0].block_ids == [1, 2, 3]


def test_blocks_already_stored_are_not_saved_again(store):
    put(store, TOKENS, 2)
    s = side(store, can_load=False)
    s.num_new_matched_tokens(Req("r", TOKENS), 0)
    s.after_alloc(Req("r", TOKENS), [1, 2, 3, 4, 5], 0)
    meta = s.build_meta(step(new=[("r", [1, 2, 3, 4, 5], 0)], scheduled={"r": 18}))
    assert meta.saves[0].block_ids == [3, 4]


def test_cache_salt_separates_tenants(store):
    put(store, TOKENS, 4, salt="a")
    s = side(store)
    assert s.num_new_matched_tokens(Req("x", TOKENS, cache_salt="a"), 0)[0] == 16
    assert s.num_new_matched_tokens(Req("y", TOKENS, cache_salt="b"), 0) == (0, False)
    assert s.num_new_matched_tokens(Req("z", TOKENS), 0) == (0, False)


def test_pd_consumer_asks_again_until_promised_blocks_are_visible(store):
    clock = Clock()
    s = side(store, clock=clock, timeout=5)
    req = Req("r", TOKENS, kv_transfer_params={"do_remote_prefill": True, PARAM_BLOCKS: 4})
    assert s.num_new_matched_tokens(req, 0) == (None, False)
    clock.now += 1
    put(store, TOKENS, 4)
    assert s.num_new_matched_tokens(req, 0) == (16, False)
    data = s._stats.take().data
    assert data["pd_wait_seconds"] == [1.0]
    assert "pd_wait_timeouts" not in data


def test_pd_consumer_says_what_the_store_gave_it(store):
    put(store, TOKENS, 4)
    s = side(store)
    loads = Req("r", TOKENS, kv_transfer_params={"do_remote_prefill": True, PARAM_BLOCKS: 4})
    computes = Req("c", [t + 1 for t in TOKENS], kv_transfer_params={"do_remote_prefill": True, PARAM_BLOCKS: 0})
    for r in (loads, computes):
        external = s.num_new_matched_tokens(r, 0)[0]
        s.after_alloc(r, [1, 2, 3, 4, 5], external)
    s.build_meta(step(new=[("r", [1, 2, 3, 4, 5], 16), ("c", [1, 2, 3, 4, 5], 0)], scheduled={"r": 2, "c": 18}))
    # The proxy's PD path check reads this (vLLM's usage shows the prefill's cached tokens on a decode).
    assert s.finished(loads) == {PARAM_LOADED: 16}
    assert s.finished(computes) == {PARAM_LOADED: 0}


def test_pd_consumer_gives_up_after_the_timeout(store):
    clock = Clock()
    s = side(store, clock=clock, timeout=5)
    put(store, TOKENS, 1)
    req = Req("r", TOKENS, kv_transfer_params={"do_remote_prefill": True, PARAM_BLOCKS: 4})
    assert s.num_new_matched_tokens(req, 0) == (None, False)
    clock.now += 5
    assert s.num_new_matched_tokens(req, 0) == (4, False)  # what is there, then recompute
    assert s._stats.take().data["pd_wait_timeouts"] == 1


def test_producer_promises_its_blocks_only_when_asked(store):
    s = side(store, can_load=False)
    plain, pd = Req("a", TOKENS), Req("b", TOKENS, kv_transfer_params={"do_remote_decode": True})
    for r in (plain, pd):
        s.num_new_matched_tokens(r, 0)
        s.after_alloc(r, [1, 2, 3, 4, 5], 0)
    meta = s.build_meta(step(new=[("a", [1, 2, 3, 4, 5], 0), ("b", [1, 2, 3, 4, 5], 0)], scheduled={"a": 18, "b": 18}))
    # The PD prefill's step ends once its blocks are written (its answer promises them).
    assert [(t.req_id, t.wait) for t in meta.saves] == [("a", False), ("b", True)]
    assert s.finished(plain) is None
    assert s.finished(pd) == {"do_remote_prefill": True, PARAM_BLOCKS: 4}
    assert s.finished(pd) is None  # state is gone once finished


def test_while_saves_fail_a_producer_promises_nothing(store):
    """A full or read-only store: the consumer would wait pd_wait_timeout_s for blocks that never
    land. Once the workers report failed saves, producers promise none; a good save ends that."""
    s = side(store, can_load=False)

    def promised(name: str) -> int:
        r = Req(name, TOKENS, kv_transfer_params={"do_remote_decode": True})
        s.num_new_matched_tokens(r, 0)
        s.after_alloc(r, [1, 2, 3, 4, 5], 0)
        s.build_meta(step(new=[(name, [1, 2, 3, 4, 5], 0)], scheduled={name: 18}))
        return s.finished(r)[PARAM_BLOCKS]

    assert promised("a") == 4
    s.worker_stats({"saved_blocks": 0, "save_failed_blocks": 4})
    assert promised("b") == 0
    s.worker_stats({"saved_blocks": 0})  # nothing saved in that step: still failing
    assert promised("c") == 0
    s.worker_stats({"saved_blocks": 4, "save_failed_blocks": 0})
    assert promised("d") == 4
    # A store whose writes hang: the saves neither fail nor land, but the PD wait for them timed out.
    s.worker_stats({"pd_save_wait_timeouts": 1})
    assert promised("e") == 0
    s.worker_stats({"saved_blocks": 4})
    assert promised("f") == 4


def test_resumed_request_replaces_its_block_list(store):
    put(store, TOKENS, 2)
    s = side(store)
    req = Req("r", TOKENS)
    s.num_new_matched_tokens(req, 0)
    s.after_alloc(req, [1, 2, 3, 4, 5], 8)
    s.build_meta(step(new=[("r", [1, 2, 3, 4, 5], 8)], scheduled={"r": 10}))
    put(store, TOKENS, 4)  # the workers wrote the blocks that step planned
    # preempted, then resumed with fresh blocks: vLLM asks again and sends the whole new list
    assert s.num_new_matched_tokens(req, 0)[0] == 16
    s.after_alloc(req, [20, 21, 22, 23, 24], 16)
    meta = s.build_meta(step(cached=[("r", [20, 21, 22, 23, 24], 16)], resumed=["r"], scheduled={"r": 2}))
    assert meta.loads[0].block_ids == [20, 21, 22, 23]


def test_tensor_parallel_ranks_use_their_own_keys():
    ids = [b"a" * 32, b"b" * 32]
    assert store_keys(ids, 0, 1) == ids
    rank0 = store_keys(ids, 0, 2)
    rank1 = rank_keys(rank0, 1, 2)
    assert rank0 != rank1 and len({*rank0, *rank1}) == 4
    assert rank_keys(rank0, 0, 2) == rank0


def test_with_tensor_parallel_a_block_is_stored_only_with_every_ranks_share(store):
    """Each rank loads its own share: a block one rank lacks (and every block after it) is a miss
    for all of them, however many shares of it the others hold."""
    ids = BlockHasher(CTX).block_ids(TOKENS)
    for rank in (0, 1, 2):
        have = ids[:4] if rank != 1 else ids[:2]  # rank 1 wrote blocks 0-1 only
        keys = store_keys(have, rank, 3)
        store.wait(store.dump(keys, [b"x"] * len(keys)))
    assert side(store, tp_size=3).num_new_matched_tokens(Req("r", TOKENS), 0) == (2 * BS, False)
    assert side(store, tp_size=1).num_new_matched_tokens(Req("q", TOKENS), 0) == (0, False)  # other keys


def test_multimodal_requests_bypass_the_store(store):
    put(store, TOKENS, 4)
    s = side(store)
    req = Req("r", TOKENS)
    req.mm_features = ["an image"]
    assert s.num_new_matched_tokens(req, 0) == (0, False)
    s.after_alloc(req, [1, 2, 3, 4, 5], 0)
    assert s.build_meta(step(new=[("r", [1, 2, 3, 4, 5], 0)], scheduled={"r": 18})).saves == []


def test_blocks_filled_while_decoding_are_saved_too_up_to_the_limit(store):
    """A chat's next turn starts with the assistant's answer: its full blocks are worth keeping."""
    s = side(store, decode_save=2)
    req = Req("r", TOKENS, kv_transfer_params={"do_remote_decode": True})  # 18 tokens: 4 full blocks + 2
    assert s.num_new_matched_tokens(req, 0) == (0, False)
    s.after_alloc(req, [0, 1, 2, 3, 4], 0)
    first = s.build_meta(step(new=[("r", [0, 1, 2, 3, 4], 0)], scheduled={"r": 18}))
    assert [t.block_ids for t in first.saves] == [[0, 1, 2, 3]]
    req.extra = list(range(500, 510))  # 10 tokens generated: 28 in all, 7 full blocks
    decoded = s.build_meta(step(cached=[("r", [5, 6], 27)], scheduled={"r": 1}))
    [save] = decoded.saves
    assert save.block_ids == [4, 5]  # blocks 4 and 5; block 6 is past the limit of 2
    assert save.store_ids == BlockHasher(CTX).block_ids(req.all_token_ids)[4:6]
    assert s.finished(req)[PARAM_BLOCKS] == 4  # what a PD consumer waits for: the prompt's blocks


def test_the_hasher_cache_does_not_grow_with_client_salts(store):
    s = side(store)
    for k in range(HASHERS_KEPT + 50):
        s.num_new_matched_tokens(Req(f"r{k}", TOKENS, cache_salt=f"salt-{k}"), 0)
        s.finished(Req(f"r{k}", TOKENS, cache_salt=f"salt-{k}"))
    assert len(s._hashers) == HASHERS_KEPT
    put(store, TOKENS, 4, salt="salt-0")  # an evicted salt is hashed again, the same way
    assert s.num_new_matched_tokens(Req("again", TOKENS, cache_salt="salt-0"), 0)[0] == 16


def test_the_stores_blocks_go_out_as_kv_events_a_router_keys_like_the_engines(store):
    """What a lookup found and what is saved, as vLLM publishes them, read by the proxy's index."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    from ucm.integration.vllm.events import StoreEvents
    from ucm_proxy.kvindex import BlockIndex, decode_batch

    put(store, TOKENS, 2, salt="t")
    s = SchedulerSide(
        CTX, store, can_load=True, can_save=True, pd_wait_timeout_s=5, stats=StatsRecorder(), events=StoreEvents(BS)
    )
    index = BlockIndex(100)

    def publish() -> None:
        wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=s.take_events()))
        index.apply("http://engine", decode_batch(wire))

    req = Req("r", TOKENS, cache_salt="t")
    assert s.num_new_matched_tokens(req, 0) == (8, False)
    s.num_new_matched_tokens(req, 0)  # asked again (vLLM may): announced once
    publish()
    assert index.cached(["http://other"], TOKENS, "t") == {"http://other": (0, 8)}  # any engine may load them
    assert index.cached(["http://other"], TOKENS, "u") == {"http://other": (0, 0)}  # another tenant's: nothing
    s.after_alloc(req, [1, 2, 3, 4, 5], 8)
    s.build_meta(step(new=[("r", [1, 2, 3, 4, 5], 8)], scheduled={"r": 10}))  # blocks 2, 3 fill: saved
    publish()
    assert index.cached(["http://other"], TOKENS, "t") == {"http://other": (0, 16)}
    assert s.take_events() == []


def test_a_lookup_that_misses_a_block_says_so(store):
    from ucm.integration.vllm.events import StoreEvents

    put(store, TOKENS, 1)
    s = SchedulerSide(
        CTX, store, can_load=True, can_save=False, pd_wait_timeout_s=5, stats=StatsRecorder(), events=StoreEvents(BS)
    )
    s.num_new_matched_tokens(Req("r", TOKENS), 0)
    present, missing = s.take_events()
    ids = BlockHasher(CTX).block_ids(TOKENS)
    assert present.block_hashes == ids[:1] and present.token_ids == TOKENS[:4] and present.medium == "STORAGE"
    assert missing.block_hashes == [ids[1]]  # evicted, say, since some engine announced it


# -- Blend -----------------------------------------------------------------------------------------
SEP = (7, 7)


def blend_side(store, **config) -> SchedulerSide:
    from ucm.integration.vllm.config import BlendConfig
    from ucm.integration.vllm.scheduler import BlendSettings

    s = side(store)
    s._blend = BlendSettings(BlendConfig(**config), SEP)
    return s


def test_split_chunks_cuts_at_every_separator():
    from ucm.integration.vllm.chunks import split_chunks

    assert split_chunks([1, 2, 7, 7, 3, 7, 7, 4], SEP) == [(0, 2), (4, 5)]
    assert split_chunks([7, 7, 1, 7, 2, 7, 7], SEP) == [(2, 5)]  # empty chunks left out; a lone 7 is text
    assert split_chunks([1, 2, 3], SEP) == []


def test_blend_claims_up_to_the_last_stored_chunk_block(store):
    """[system 6][sep][A 9][sep][B 6][sep][q 3]: A cached alone (2 of its blocks), B not at all."""
    system, a, b, q = list(range(200, 206)), list(range(300, 309)), list(range(400, 406)), [1, 2, 3]
    put(store, a, 2)
    prompt = system + list(SEP) + a + list(SEP) + b + list(SEP) + q
    s = blend_side(store, selection="deviation")  # the region ends at the last chunk
    req = Req("r", prompt)
    a_at = len(system) + 2
    assert s.num_new_matched_tokens(req, 0) == (a_at + 2 * BS, False)
    blocks = list(range(10, 10 + len(prompt) // BS + 1))
    s.after_alloc(req, blocks, a_at + 2 * BS)
    meta = s.build_meta(step(new=[("r", blocks, a_at + 2 * BS)], scheduled={"r": len(prompt) - a_at - 2 * BS}))
    (blend,) = meta.blends
    assert (blend.computed, blend.first_block, len(blend.tokens)) == (0, 0, a_at + 2 * BS)
    assert blend.tokens == prompt[: a_at + 2 * BS]
    assert [(start, len(keys)) for start, keys in blend.chunks] == [(a_at, 2)]
    assert blend.block_ids == blocks[: -(-(a_at + 2 * BS) // BS)]
    # blended KV is approximate: stored under the blend's ids, never as the prompt's exact blocks
    (save,) = meta.saves
    exact = BlockHasher(CTX).block_ids(prompt)
    blended = BlockHasher(CTX.for_request("", s._blend.fingerprint)).block_ids(prompt)
    assert save.store_ids == blended[: len(save.store_ids)] and not set(save.store_ids) & set(exact)
    assert meta.loads == []
    assert s._stats.take().data["blend_chunks_missed"] == 2  # the system prompt and B


def test_blend_loads_the_exact_prefix_first(store):
    system, a, q = list(range(200, 209)), list(range(300, 309)), [1, 2]
    put(store, system, 2)
    put(store, a, 2)
    prompt = system + list(SEP) + a + list(SEP) + q
    s = blend_side(store, selection="deviation")  # the region ends at the last chunk
    req = Req("r", prompt)
    end = len(system) + 2 + 2 * BS
    assert s.num_new_matched_tokens(req, 0) == (end, False)
    blocks = list(range(len(prompt) // BS + 1))
    s.after_alloc(req, blocks, end)
    meta = s.build_meta(step(new=[("r", blocks, 0)], scheduled={"r": len(prompt) - end}))
    (load,) = meta.loads
    assert load.block_ids == blocks[:2]  # the system prompt's exact blocks, loaded as usual
    assert (meta.blends[0].computed, meta.blends[0].first_block) == (2 * BS, 2)


def test_the_attention_selection_blends_up_to_the_last_token(store):
    """The question picks what to recompute, so the region runs over it: vLLM computes one token."""
    system, a, q = list(range(200, 206)), list(range(300, 309)), [1, 2, 3]
    put(store, a, 2)
    prompt = system + list(SEP) + a + list(SEP) + q
    deviation = blend_side(store, selection="deviation")
    assert deviation.num_new_matched_tokens(Req("r", prompt), 0) == (len(system) + 2 + 2 * BS, False)
    s = blend_side(store)  # the default
    assert s.num_new_matched_tokens(Req("r", prompt), 0) == (len(prompt) - 1, False)
    assert s.num_new_matched_tokens(Req("r2", system + list(SEP) + q), 0) == (0, False)  # no chunk cached


def test_the_attention_selection_blends_nothing_the_exact_prefix_holds(store):
    """A prompt whose only cached chunk is its start: the store's exact prefix is loaded as usual,
    with no blend over the rest (there is nothing to reuse in it)."""
    a = list(range(300, 309))
    put(store, a, 2)
    s = blend_side(store)
    assert s.num_new_matched_tokens(Req("r", a + list(SEP) + [1, 2, 3]), 0) == (2 * BS, False)
    assert s._requests["r"].blend is None


def test_a_question_past_max_blend_tokens_leaves_the_region_at_the_chunks(store):
    system, a, q = list(range(200, 206)), list(range(300, 309)), list(range(1, 30))
    put(store, a, 2)
    prompt = system + list(SEP) + a + list(SEP) + q
    chunk_end = len(system) + 2 + 2 * BS
    s = blend_side(store, max_blend_tokens=chunk_end)
    assert s.num_new_matched_tokens(Req("r", prompt), 0) == (chunk_end, False)


@pytest.mark.parametrize(
    ("config", "salt"),
    [({}, "other-tenant"), ({"max_blend_tokens": 4}, ""), ({"max_chunks": 1}, "")],
)
def test_no_blend_for_another_tenant_or_past_the_limits(store, config, salt):
    a, b = list(range(300, 309)), list(range(400, 409))
    put(store, a, 2)
    put(store, b, 2)
    s = blend_side(store, **config)
    req = Req("r", list(range(200, 206)) + list(SEP) + b + list(SEP) + a + list(SEP) + [1], cache_salt=salt)
    assert s.num_new_matched_tokens(req, 0) == (0, False)


def test_a_pd_consumer_loads_what_its_producer_blended(store):
    """The producer blends after an exact prefix of 2 blocks, saves every prompt block and names the
    blend in its answer; the consumer looks up the exact blocks, then the blend's, and loads them."""
    system, a, q = list(range(200, 209)), list(range(300, 309)), [1, 2, 3, 4, 5]
    put(store, system, 2)
    put(store, a, 2)
    prompt = system + list(SEP) + a + list(SEP) + q
    producer = blend_side(store)
    req = Req("p", prompt, kv_transfer_params={"do_remote_decode": True})
    external, _ = producer.num_new_matched_tokens(req, 0)
    blocks = list(range(len(prompt) // BS + 1))
    producer.after_alloc(req, blocks, external)
    meta = producer.build_meta(step(new=[("p", blocks, external)], scheduled={"p": len(prompt) - external}))
    store.wait(store.dump(meta.saves[0].store_ids, [b"x"] * len(meta.saves[0].store_ids)))  # as the workers do
    answer = producer.finished(req)
    n_blocks = len(prompt) // BS
    assert answer == {"do_remote_prefill": True, PARAM_BLOCKS: n_blocks, PARAM_BLEND: [producer._blend.fingerprint, 2]}
    consumer = side(store)
    creq = Req("c", prompt, kv_transfer_params=answer)
    assert consumer.num_new_matched_tokens(creq, 0) == (n_blocks * BS, False)
    consumer.after_alloc(creq, blocks, n_blocks * BS)
    cmeta = consumer.build_meta(step(new=[("c", blocks, n_blocks * BS)], scheduled={"c": len(prompt) - n_blocks * BS}))
    exact = BlockHasher(CTX).block_ids(prompt)[:2]  # the system prompt's, stored before
    assert meta.saves[0].block_ids == blocks[2:n_blocks]
    assert cmeta.loads[0].store_ids == exact + meta.saves[0].store_ids


@pytest.mark.parametrize("bad", ["x", ["fp"], ["fp", -1], ["fp", True], [7, 1], ["f" * 65, 1]])
def test_a_malformed_blend_parameter_is_ignored(store, bad):
    prompt = list(range(100, 118))
    put(store, prompt, 4)
    s = side(store)
    req = Req("r", prompt, kv_transfer_params={PARAM_BLEND: bad})
    assert s.num_new_matched_tokens(req, 0) == (16, False)  # the exact blocks, as without it


def test_a_clients_chunk_boundaries_replace_the_separators(store):
    """[system 6][A 9][B 6][q 3] without separators: the client says where A and B are."""
    system, a, b, q = list(range(200, 206)), list(range(300, 309)), list(range(400, 406)), [1, 2, 3]
    put(store, a, 2)
    prompt = system + a + b + q
    s = blend_side(store, selection="deviation")  # the region ends at the last chunk
    at = len(system)
    chunks = [[0, at], [at, at + len(a)], [at + len(a), at + len(a) + len(b)]]
    req = Req("r", prompt, kv_transfer_params={PARAM_CHUNKS: chunks})
    assert s.num_new_matched_tokens(req, 0) == (at + 2 * BS, False)
    assert s.num_new_matched_tokens(Req("plain", prompt), 0) == (0, False)  # no separator: no chunk
    s._stats.take()  # what the requests above recorded
    many = Req("many", prompt, kv_transfer_params={PARAM_CHUNKS: [[i, i + 1] for i in range(65)]})
    assert s.num_new_matched_tokens(many, 0) == (0, False)  # past max_chunks (64): prefilled as usual
    assert s._stats.take().data["blend_chunk_lists_refused"] == 1


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("0-6", "expected a list"),
        ([[0, 6, 9]], "[0]: expected [start, end]"),
        ([[0, True]], "[0]: expected [start, end]"),
        ([[0, 6], [5, 9]], "[1]: [5, 9] must satisfy 6 <= start"),  # overlapping
        ([[3, 3]], "[0]: [3, 3]"),  # empty
        ([[0, 99]], "end <= 24"),  # past the prompt
        ([[0, 1]] * 100_000, ": at most 64 chunks"),  # blend.max_chunks; not read entry by entry
    ],
)
def test_a_malformed_chunk_list_is_refused_once_and_the_prompt_prefilled(store, caplog, bad, says):
    a = list(range(300, 309))
    put(store, a, 2)
    prompt = list(range(200, 206)) + a + list(range(400, 409))
    s = blend_side(store)
    req = Req("r", prompt, kv_transfer_params={PARAM_CHUNKS: bad})
    assert s.num_new_matched_tokens(req, 0) == (0, False)
    assert s.num_new_matched_tokens(req, 0) == (0, False)
    assert "kv_transfer_params.ucm_chunks" in caplog.text and says in caplog.text
    assert caplog.text.count("prefilled without Blend") == 1
    assert s._stats.take().data["blend_chunk_lists_refused"] == 1


# -- LoRA adapters -----------------------------------------------------------------------------------
def adapter_dir(tmp_path, name: str, weights: bytes) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return str(path)


def lora(name: str, adapter_id: int, path: str) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=adapter_id, lora_path=path)


def adapter_req(req_id: str, request_lora: SimpleNamespace | None, **kw) -> Req:
    req = Req(req_id, TOKENS, **kw)
    req.lora_request = request_lora
    return req


def test_an_adapters_blocks_are_its_own(store, tmp_path):
    """Base, adapter, and another adapter under the same name: three sets of ids, none loaded by another."""
    a1 = adapter_dir(tmp_path, "a1", b"one")
    a2 = adapter_dir(tmp_path, "a2", b"two")
    producer = side(store)
    req = adapter_req("r", lora("ad", 1, a1))
    producer.num_new_matched_tokens(req, 0)
    producer.after_alloc(req, [1, 2, 3, 4, 5], 0)
    [save] = producer.build_meta(step(new=[("r", [1, 2, 3, 4, 5], 0)], scheduled={"r": 18})).saves
    assert set(save.store_ids).isdisjoint(BlockHasher(CTX).block_ids(TOKENS))
    store.wait(store.dump(save.store_ids, [b"x"] * len(save.store_ids)))  # what the workers write
    consumer = side(store)  # another engine on the same store
    assert consumer.num_new_matched_tokens(adapter_req("base", None), 0) == (0, False)
    assert consumer.num_new_matched_tokens(adapter_req("other", lora("ad", 1, a2)), 0) == (0, False)
    # the same weights under another name, id and path: the same KV, loaded
    copy = adapter_dir(tmp_path, "copy", b"one")
    assert consumer.num_new_matched_tokens(adapter_req("same", lora("mine", 7, copy)), 0) == (4 * BS, False)


def test_an_adapter_that_cannot_be_named_bypasses_the_store(store, tmp_path):
    s = side(store)
    hub = adapter_req("r", lora("ad", 1, "org/adapter-on-a-hub"))
    assert s.num_new_matched_tokens(hub, 0) == (0, False)
    s.after_alloc(hub, [1, 2, 3, 4, 5], 0)
    assert s.build_meta(step(new=[("r", [1, 2, 3, 4, 5], 0)], scheduled={"r": 18})).saves == []
    assert s._stats.take().data["bypassed_adapter_requests"] == 1


def test_an_adapter_changed_under_the_engine_stays_out_of_the_store(store, tmp_path, caplog):
    """The workers loaded the adapter once: files changed in place, or its id given another path,
    leave nobody knowing which weights they hold."""
    path = adapter_dir(tmp_path, "a1", b"one")
    s = side(store)
    s.num_new_matched_tokens(adapter_req("r1", lora("ad", 1, path)), 0)
    (tmp_path / "a1" / "adapter_model.safetensors").write_bytes(b"other weights")
    assert s.num_new_matched_tokens(adapter_req("r2", lora("ad", 1, path)), 0) == (0, False)
    assert "changed since the engine first loaded it" in caplog.text
    moved = adapter_dir(tmp_path, "a2", b"two")
    s.num_new_matched_tokens(adapter_req("r3", lora("bd", 2, moved)), 0)
    other = adapter_dir(tmp_path, "a3", b"three")
    s.num_new_matched_tokens(adapter_req("r4", lora("bd", 2, other)), 0)
    assert s._stats.take().data["bypassed_adapter_requests"] == 2


def test_prompt_embeddings_bypass_the_store(store):
    put(store, TOKENS, 4)
    s = side(store)
    req = Req("r", TOKENS)
    req.prompt_embeds = object()  # vLLM's tensor of rows: numbers no token names
    assert s.num_new_matched_tokens(req, 0) == (0, False)
    assert s._stats.take().data == {"bypassed_prompt_embeds_requests": 1}


def test_an_adapter_requests_blocks_go_out_as_events_under_its_name(store, tmp_path):
    """As vLLM announces them: the adapter's name among every block's extra keys, the salt on the first."""
    from ucm.integration.vllm.events import StoreEvents

    path = adapter_dir(tmp_path, "a1", b"one")
    s = SchedulerSide(
        CTX, store, can_load=True, can_save=True, pd_wait_timeout_s=5, stats=StatsRecorder(), events=StoreEvents(BS)
    )
    req = adapter_req("r", lora("ad", 1, path), cache_salt="t")
    s.num_new_matched_tokens(req, 0)
    s.after_alloc(req, [1, 2, 3, 4, 5], 0)
    s.build_meta(step(new=[("r", [1, 2, 3, 4, 5], 0)], scheduled={"r": 18}))
    [_, stored] = s.take_events()
    assert stored.lora_name == "ad"
    assert stored.extra_keys == [("ad", "t"), ("ad",), ("ad",), ("ad",)]


def test_adapter_requests_are_not_blended(store, tmp_path):
    """Blend computes with the model's own layers, without the request's adapter."""
    s = blend_side(store)
    path = adapter_dir(tmp_path, "a1", b"one")
    chunk = list(range(200, 208))
    prompt = [1, 2, *SEP, *chunk, *SEP, 9, 9, 9]
    put(store, chunk, 2)
    req = Req("r", prompt)
    req.lora_request = lora("ad", 1, path)
    assert s.num_new_matched_tokens(req, 0) == (0, False)
    base = Req("b", prompt)
    assert s.num_new_matched_tokens(base, 0)[0] > 0  # the same prompt without an adapter blends
