"""UCMConnector inside real vLLM (CPU build) servers sharing one store.

Three servers: P, the session's plain vLLM (the reference output); A, a ``kv_producer``
writing to the store; B, a ``kv_both`` instance on ``cache|posix`` over the same directory. Each
test uses prompts B has not seen, so B's own prefix cache cannot serve them: hits come from the
store or not at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ucm.hashing import BlockHasher, HashContext
from ucm.integration.vllm.config import kv_transfer_config
from ucm.integration.vllm.identity import weights_fingerprint
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import ServerFailed, VLLMServer, cached_tokens, serving

pytestmark = [pytest.mark.slow, pytest.mark.engines]
BS = 32


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def servers(tiny_model, store_dir, tmp_path_factory, plain):
    logs = tmp_path_factory.mktemp("logs")
    posix = {"spec": "posix", "posix": {"roots": [str(store_dir)]}}
    tiered = {"spec": "cache|posix", "cache": {"capacity": "256MiB"}, "posix": {"roots": [str(store_dir)]}}
    ours = {
        "A": VLLMServer(tiny_model, logs / "producer.log", kv_transfer_config=kv_transfer_config(posix, "kv_producer")),
        "B": VLLMServer(
            tiny_model,
            logs / "both.log",
            kv_transfer_config=kv_transfer_config(tiered, "kv_both", pd_wait_timeout_s=20),
        ),
    }
    with serving(*ours.values()):
        yield {"P": plain, **ours}


def tokens(server: VLLMServer, prompt, **kw) -> tuple[str, int]:
    r = server.complete(prompt, max_tokens=24, **kw)
    return r["choices"][0]["text"], cached_tokens(r)


def prompt_ids(tiny_model, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)(text)["input_ids"]


def block_file(store_dir: Path, tiny_model, prompt: str, index: int) -> Path:
    """The file of the prompt's block ``index``: ids computed as the connector computes them."""
    context = HashContext(
        model=str(tiny_model), dtype="float32", block_size=BS, weights=weights_fingerprint(str(tiny_model))
    )
    block_id = BlockHasher(context).block_ids(prompt_ids(tiny_model, prompt))[index].hex()
    return store_dir / block_id[:2] / block_id


def test_second_instance_loads_every_full_prompt_block(servers, tiny_model):
    P, A, B = servers["P"], servers["A"], servers["B"]
    prompt = PROMPTS[0]
    n_tokens = len(prompt_ids(tiny_model, prompt))
    before = B.metrics()
    reference, _ = tokens(P, prompt)
    produced, _ = tokens(A, prompt)
    assert produced == reference
    reused, hit = tokens(B, prompt)
    assert reused == reference
    full_blocks = n_tokens // BS
    expected = min(full_blocks * BS, n_tokens - 1)  # vLLM must compute at least one token
    assert hit == expected
    after = B.metrics()
    assert (
        after["ucm_connector_loaded_blocks_total"] - before.get("ucm_connector_loaded_blocks_total", 0) == full_blocks
    )
    assert (
        after["ucm_connector_external_hit_tokens_total"] - before.get("ucm_connector_external_hit_tokens_total", 0)
        == expected
    )


def test_partial_prefix_hits_exactly_the_shared_blocks(servers, tiny_model):
    P, A, B = servers["P"], servers["A"], servers["B"]
    stored = prompt_ids(tiny_model, PROMPTS[1])
    other = prompt_ids(tiny_model, PROMPTS[2])
    k = 2
    mixed = stored[: k * BS] + other[k * BS :]
    tokens(A, stored)
    reference, _ = tokens(P, mixed)
    out, hit = tokens(B, mixed)
    assert hit == k * BS
    assert out == reference


def test_pd_producer_then_consumer(servers, tiny_model):
    P, A, B = servers["P"], servers["A"], servers["B"]
    prompt = PROMPTS[3]
    n_tokens = len(prompt_ids(tiny_model, prompt))
    prefill = A.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["ucm_blocks"] == n_tokens // BS
    reference, _ = tokens(P, prompt)
    before = B.metrics()
    decoded, _ = tokens(B, prompt, kv_transfer_params=params)
    assert decoded == reference
    # (With do_remote_prefill, vLLM reports the prefill side's cache hits as cached_tokens.)
    after = B.metrics()
    assert after["ucm_connector_loaded_blocks_total"] - before["ucm_connector_loaded_blocks_total"] == n_tokens // BS
    assert after["ucm_connector_external_hit_tokens_total"] - before["ucm_connector_external_hit_tokens_total"] == min(
        n_tokens // BS * BS, n_tokens - 1
    )


def test_consumer_waits_for_promised_blocks_then_recomputes(servers, tiny_model):
    P, B = servers["P"], servers["B"]
    prompt = PROMPTS[4]
    before = B.metrics()
    # Promised by a producer that never wrote them: B waits pd_wait_timeout_s, then computes.
    out, _ = tokens(B, prompt, kv_transfer_params={"do_remote_prefill": True, "ucm_blocks": 3})
    assert out == tokens(P, prompt)[0]
    after = B.metrics()
    assert after["ucm_connector_loaded_blocks_total"] == before["ucm_connector_loaded_blocks_total"]
    assert after["ucm_connector_pd_wait_timeouts_total"] - before.get("ucm_connector_pd_wait_timeouts_total", 0) == 1


def test_corrupt_block_is_recomputed_and_counted(servers, tiny_model, store_dir):
    P, A, B = servers["P"], servers["A"], servers["B"]
    prompt = PROMPTS[5]
    tokens(A, prompt)
    victim = block_file(store_dir, tiny_model, prompt, 1)
    data = bytearray(victim.read_bytes())
    data[1000] ^= 0xFF
    victim.write_bytes(data)
    before = B.metrics()
    out, _ = tokens(B, prompt)
    assert out == tokens(P, prompt)[0]
    after = B.metrics()
    assert (
        after["ucm_connector_load_failed_blocks_total"] - before.get("ucm_connector_load_failed_blocks_total", 0) >= 1
    )
    assert (
        after["ucm_connector_store_corrupt_blocks_total"] - before.get("ucm_connector_store_corrupt_blocks_total", 0)
        == 1
    )


def test_deleted_block_shortens_the_hit(servers, tiny_model, store_dir):
    P, A, B = servers["P"], servers["A"], servers["B"]
    prompt = PROMPTS[6]
    tokens(A, prompt)
    block_file(store_dir, tiny_model, prompt, 2).unlink()
    out, hit = tokens(B, prompt)
    assert hit == 2 * BS  # blocks 0 and 1; a prefix never skips a hole
    assert out == tokens(P, prompt)[0]


def test_tenant_salts_never_share_blocks(servers):
    P, A, B = servers["P"], servers["A"], servers["B"]
    prompt = PROMPTS[7]
    tokens(A, prompt, cache_salt="tenant-a")
    out_b, hit_b = tokens(B, prompt, cache_salt="tenant-b")
    assert hit_b == 0
    assert out_b == tokens(P, prompt)[0]
    _, hit_a = tokens(B, PROMPTS[7], cache_salt="tenant-a")
    assert hit_a > 0


def test_bad_extra_config_fails_at_startup_naming_the_field(tiny_model, tmp_path):
    bad = kv_transfer_config({"spec": "posix", "posix": {"roots": [str(tmp_path / "missing")]}})
    server = VLLMServer(tiny_model, tmp_path / "bad.log", kv_transfer_config=bad).start()
    try:
        with pytest.raises(ServerFailed) as exc:
            server.wait_ready(timeout=180)
        assert "kv_connector_extra_config.store.posix.roots[0]" in str(exc.value)
        assert "does not exist" in str(exc.value)
    finally:
        server.stop()
