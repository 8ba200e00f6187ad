"""Blend inside real vLLM (CPU build) servers: chunks cached alone, then reused at other positions in
other prompts.

P is the session's plain vLLM (the reference); B blends with the default configuration (the question's attention
picks what to recompute, so the blend runs to the prompt's last token); S blends with
``check_layer`` 0 and ratio 0 (every reused token keeps its cached KV in the layers after the
first); A is S recomputing every reused token after the attention selection's first pass; D
decodes what B prefilled (PD through the store), without a blend configuration of its own. The tiny
model has two layers: with the default ``check_layer`` 1 every KV B writes is computed fresh (layer
0 for every token, layer 1 at the check), so B's tokens must equal P's — this checks what serving
adds (the plan, loading, re-rotation, the cache writes, the question computed over them); how the
ratio trades accuracy is checked on the model's layers in test_blend_compute.py. Prompts are token
ids, so chunk boundaries are exact.
"""

from __future__ import annotations

import json

import pytest

from ucm.hashing import BlockHasher, HashContext
from ucm.integration.vllm.config import blend_overrides, kv_transfer_config
from ucm.integration.vllm.identity import weights_fingerprint
from ucm_testing.vllm_server import VLLMServer, cached_tokens, serving

pytestmark = [pytest.mark.slow, pytest.mark.engines]
BS = 32
SEPARATOR = "\n---\n"
OVERRIDE = ["--hf-overrides", json.dumps(blend_overrides())]


@pytest.fixture(scope="module")
def separator(tiny_model) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model)).encode(SEPARATOR, add_special_tokens=False)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def servers(tiny_model, store_dir, tmp_path_factory, plain):
    logs = tmp_path_factory.mktemp("logs")
    store = {"spec": "posix", "posix": {"roots": [str(store_dir)]}}
    stale = {"separator": SEPARATOR, "check_layer": 0, "recompute_ratio": 0.0, "selection": "deviation"}
    attention = {**stale, "recompute_ratio": 1.0, "selection": "attention"}
    ours = {
        "B": VLLMServer(
            tiny_model,
            logs / "blend.log",
            kv_transfer_config=kv_transfer_config(store, blend={"separator": SEPARATOR}),
            extra_args=OVERRIDE,
        ),
        "S": VLLMServer(
            tiny_model,
            logs / "stale.log",
            kv_transfer_config=kv_transfer_config(store, blend=stale),
            extra_args=OVERRIDE,
        ),
        "A": VLLMServer(
            tiny_model,
            logs / "attention.log",
            kv_transfer_config=kv_transfer_config(store, blend=attention),
            extra_args=OVERRIDE,
        ),
        "D": VLLMServer(tiny_model, logs / "decode.log", kv_transfer_config=kv_transfer_config(store)),
    }
    with serving(*ours.values()):
        yield {"P": plain, **ours}


def words(n: int, seed: int) -> list[int]:
    """Token ids that are no separator token (the tiny vocabulary's ids 40..500)."""
    return [40 + (seed * 7919 + i * 104729) % 460 for i in range(n)]


def complete(server: VLLMServer, prompt: list[int], **kw) -> tuple[list[int], int]:
    r = server.complete(prompt, max_tokens=24, logprobs=0, **kw)
    choice = r["choices"][0]
    return choice["logprobs"]["tokens"], cached_tokens(r)


def rag(separator: list[int], *parts: list[int]) -> list[int]:
    """``parts`` joined by the separator: chunks, then the question."""
    out = list(parts[0])
    for part in parts[1:]:
        out += separator + part
    return out


def grew(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


def as_plain(servers, name: str, prompt: list[int], **kw) -> tuple[int, dict[str, float], dict[str, float]]:
    """Server ``name``'s answer to ``prompt`` (``kw``: its request's extra fields) is plain vLLM's, token
    for token; its prefix hit and its metrics before and after the request."""
    reference, _ = complete(servers["P"], prompt)
    server = servers[name]
    before = server.metrics()
    out, hit = complete(server, prompt, **kw)
    assert out == reference
    return hit, before, server.metrics()


def cache_alone(server: VLLMServer, *chunks: list[int], **kw) -> None:
    for chunk in chunks:
        server.complete(chunk, max_tokens=1, **kw)


def test_chunks_cached_alone_are_reused_in_another_order(servers, separator):
    system, first, second, question = words(40, 1), words(100, 2), words(90, 3), words(20, 4)
    cache_alone(servers["B"], first, second)
    prompt = rag(separator, system, second, first, question)
    hit, before, after = as_plain(servers, "B", prompt)
    assert hit == len(prompt) - 1  # the default selection (attention) blends the question too
    assert grew(before, after, "ucm_connector_blend_chunks_hit_total") == 2
    assert grew(before, after, "ucm_connector_blend_chunks_missed_total") == 1  # the system prompt was never cached
    blended = sum(grew(before, after, f"ucm_connector_blend_{k}_tokens_total") for k in ("reused", "recomputed"))
    assert blended == hit


def test_a_clients_chunk_boundaries_work_without_separators(servers):
    """kv_transfer_params.ucm_chunks (what the proxy sends for its ucm_chunks field): token offsets."""
    P, B = servers["P"], servers["B"]
    system, first, second, question = words(40, 31), words(100, 32), words(90, 33), words(20, 34)
    cache_alone(B, first, second)
    prompt = system + second + first + question
    first_at = len(system + second)
    chunks = [[0, len(system)], [len(system), first_at], [first_at, first_at + len(first)]]
    hit, before, _ = as_plain(servers, "B", prompt, kv_transfer_params={"ucm_chunks": chunks})
    assert hit == len(prompt) - 1
    other = words(40, 35) + second + first + question  # not in vLLM's own prefix cache
    out, hit = complete(B, other, kv_transfer_params={"ucm_chunks": [[0, 10], [5, 20]]})  # overlapping
    assert (out, hit) == (complete(P, other)[0], 0)  # refused: prefilled as usual
    after = B.metrics()
    assert grew(before, after, "ucm_connector_blend_chunks_hit_total") == 2
    assert grew(before, after, "ucm_connector_blend_chunk_lists_refused_total") == 1


def test_an_exact_prefix_is_loaded_and_blended_over(servers, separator):
    """The system prompt's full blocks come from the store exactly (loaded before the blend, which
    reads them back from the paged cache: its queries attend over them)."""
    system, first, second, question = words(72, 15), words(80, 16), words(70, 17), words(20, 18)
    cache_alone(servers["B"], system, first, second)
    prompt = rag(separator, system, second, first, question)
    hit, before, after = as_plain(servers, "B", prompt)
    assert hit == len(prompt) - 1
    blended = sum(grew(before, after, f"ucm_connector_blend_{k}_tokens_total") for k in ("reused", "recomputed"))
    assert blended == hit - 2 * BS  # the system prompt's 2 full blocks were exact: loaded, not blended


def test_pd_decode_loads_the_blended_prompt(servers, separator):
    """B prefills (blending) for a remote decode: its blocks past the exact prefix are stored under
    the blend's ids and its answer names them; D loads every prompt block and continues as plain
    vLLM would (the tiny model's blend is exact, see above)."""
    P, B, D = servers["P"], servers["B"], servers["D"]
    system, first, second, question = words(40, 19), words(96, 20), words(70, 21), words(30, 22)
    cache_alone(B, first, second)
    prompt = rag(separator, system, second, first, question)
    prefill = B.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = prefill["kv_transfer_params"]
    full_blocks = len(prompt) // BS
    assert params["ucm_blocks"] == full_blocks and params["ucm_blend"][1] == 0
    reference, _ = complete(P, prompt)
    r = D.complete(prompt, max_tokens=24, logprobs=0, kv_transfer_params=params)
    assert r["choices"][0]["logprobs"]["tokens"] == reference
    assert r["kv_transfer_params"]["ucm_loaded_tokens"] == full_blocks * BS


def test_reused_kv_is_kept_past_the_check_layer(servers, separator):
    """At ratio 0 the chunk tokens keep their cached KV after check_layer 0: only the tokens no
    chunk covers and each chunk's first tokens are recomputed, and the answer still comes."""
    S = servers["S"]
    system, first, second, question = words(40, 5), words(64, 6), words(64, 7), words(20, 8)
    cache_alone(S, first, second)
    before = S.metrics()
    prompt = rag(separator, system, second, first, question)
    out, hit = complete(S, prompt)
    assert len(out) == 24
    assert hit == len(prompt) - len(separator + question)
    after = S.metrics()
    reused = grew(before, after, "ucm_connector_blend_reused_tokens_total")
    # both chunks but their first recompute_chunk_start (16) tokens; the system prompt and separators
    # were recomputed
    assert reused == 2 * (64 - 16)


def test_the_attention_selections_first_pass_leaves_nothing_behind(servers, separator):
    """A's first pass runs layer 1 for the tokens without a cached KV over the chunks' stale layer-1 KV
    and writes what it computes into the paged cache; at ratio 1 the second pass recomputes every
    token, so nothing of the first may remain: the answer is plain vLLM's, token for token."""
    system, first, second, question = words(40, 26), words(64, 27), words(64, 28), words(20, 29)
    cache_alone(servers["A"], first, second)
    prompt = rag(separator, system, second, first, question)
    hit, before, after = as_plain(servers, "A", prompt)
    assert hit == len(prompt) - 1  # the region runs to the last token: the question picks
    assert grew(before, after, "ucm_connector_blend_reused_tokens_total") == 0
    assert grew(before, after, "ucm_connector_blend_recomputed_tokens_total") == hit


def test_another_tenants_chunks_are_never_used(servers, separator):
    system, chunk, question = words(40, 9), words(96, 10), words(20, 11)
    cache_alone(servers["B"], chunk, cache_salt="tenant-a")
    prompt = rag(separator, system, chunk, question)
    hit, before, after = as_plain(servers, "B", prompt, cache_salt="tenant-b")
    assert hit == 0
    assert grew(before, after, "ucm_connector_blend_chunks_hit_total") == 0


def test_a_prompt_without_cached_chunks_is_prefilled_as_usual(servers, separator):
    prompt = rag(separator, words(50, 12), words(70, 13), words(10, 14))
    hit, _, _ = as_plain(servers, "B", prompt)
    assert hit == 0


def test_a_corrupt_chunk_block_is_computed_not_reused(servers, separator, tiny_model, store_dir):
    """S keeps cached KV past its check layer: a chunk block that fails its integrity check must not
    be among it (it is computed with the tokens no chunk covers)."""
    S = servers["S"]
    system, chunk, question = words(40, 23), words(96, 24), words(20, 25)
    cache_alone(S, chunk)
    context = HashContext(
        model=str(tiny_model), dtype="float32", block_size=BS, weights=weights_fingerprint(str(tiny_model))
    )
    victim = BlockHasher(context).block_ids(chunk)[1].hex()
    path = store_dir / victim[:2] / victim
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF
    path.write_bytes(data)
    before = S.metrics()
    out, hit = complete(S, rag(separator, system, chunk, question))
    assert len(out) == 24
    after = S.metrics()
    assert hit == len(system + separator) + 3 * BS  # the region still ends after the chunk's blocks
    assert grew(before, after, "ucm_connector_store_corrupt_blocks_total") == 1
    # blocks 0 (but its first 16 tokens, a chunk's start) and 2; not block 1
    assert grew(before, after, "ucm_connector_blend_reused_tokens_total") == 2 * BS - 16
