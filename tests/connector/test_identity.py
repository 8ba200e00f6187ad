"""Block ids name the weights, not only the model's name: other weights under the same name (or
at the same path) never share blocks; the same weights at another path do. Parallel layouts are
bound into keys, or refused."""

from __future__ import annotations

import asyncio
import shutil
import types

import pytest
from safetensors.numpy import load_file, save_file

from ucm.config import ConfigError
from ucm.hashing import BlockHasher, HashContext
from ucm.integration.vllm.config import check_parallel_layout, shares_per_rank
from ucm.integration.vllm.health import IDENTITY_ENV, HealthMiddleware
from ucm.integration.vllm.identity import pairing_identity, weights_fingerprint
from ucm.integration.vllm.metadata import rank_keys, store_keys

TOKENS = list(range(64))


def ids(weights: str = "", **context) -> list[bytes]:
    return BlockHasher(HashContext("served-name", "bfloat16", 32, weights=weights, **context)).block_ids(TOKENS)


@pytest.fixture
def model(tiny_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    return copy


def test_the_same_weights_at_another_path_fingerprint_the_same(tiny_model, model):
    assert weights_fingerprint(str(model)) == weights_fingerprint(str(tiny_model))


def test_a_fine_tune_of_the_same_shape_fingerprints_differently(tiny_model, model):
    """Same names, sizes and config: only the numbers differ, as after fine-tuning."""
    path = model / "model.safetensors"
    tensors = {k: v * 1.01 for k, v in load_file(path).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == (tiny_model / "model.safetensors").stat().st_size
    assert weights_fingerprint(str(model)) != weights_fingerprint(str(tiny_model))
    assert ids(weights_fingerprint(str(model))) != ids(weights_fingerprint(str(tiny_model)))


def test_a_config_change_fingerprints_differently(tiny_model, model):
    config = model / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert weights_fingerprint(str(model)) != weights_fingerprint(str(tiny_model))


def test_a_hub_id_is_named_by_its_revision():
    assert weights_fingerprint("org/model", "abc123") == "revision:abc123"
    assert weights_fingerprint("org/model", None) == "revision:unpinned"


def test_pipeline_stages_store_under_their_own_keys():
    block = ids()[:1]
    tp, pp = 2, 2
    keys = {store_keys(block, pp_rank * tp + tp_rank, tp * pp)[0] for pp_rank in range(pp) for tp_rank in range(tp)}
    assert len(keys) == 4  # no two workers share a key
    rank0 = store_keys(block, 0, tp * pp)
    assert rank_keys(rank0, 3, tp * pp) == store_keys(block, 3, tp * pp)
    assert ids(pp_size=2) != ids()  # and the layout is in the seed


def test_context_parallel_layouts_are_refused():
    check_parallel_layout(types.SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1))
    with pytest.raises(ConfigError, match="decode_context_parallel_size=2 is not supported"):
        check_parallel_layout(types.SimpleNamespace(decode_context_parallel_size=2, prefill_context_parallel_size=1))


def test_engines_that_can_share_kv_have_one_pairing_identity():
    store = {"spec": "mooncake", "mooncake": {"master_server_address": "m:50051", "local_hostname": "${POD_IP}"}}
    args = ["--model", "/models/llama", "--dtype", "bfloat16", "--block-size", "32", "--port", "8000"]
    prefill = pairing_identity({"store": store, "pd_save_wait_s": 5}, args)
    # another pod of the pool, and a decode: other ports, waits and sparse attention, same KV
    decode = pairing_identity({"store": store, "sparse": {"algorithm": "esa"}}, [*args[:-1], "8001"])
    assert prefill == decode and len(prefill) == 16
    # what changes block ids or where blocks live makes another identity
    assert pairing_identity({"store": store}, [*args[:5], "16"]) != prefill  # block size
    assert pairing_identity({"store": store}, ["--model", "/models/other", *args[2:]]) != prefill
    assert pairing_identity({"store": store, "salt": "acme"}, args) != prefill
    assert pairing_identity({"store": {**store, "spec": "cache|mooncake"}}, args) != prefill
    assert pairing_identity({"store": store}, [*args, "--tensor-parallel-size=2"]) != prefill
    # pools of different TP pair when both split blocks in the store the same way
    tp2 = pairing_identity({"store": store}, [*args, "-tp", "2"])
    assert pairing_identity({"store": store, "store_tp": 2}, args) == tp2
    assert pairing_identity({"store": store, "store_tp": 2}, [*args, "--tensor-parallel-size", "2"]) == tp2
    assert pairing_identity({"store": store}, [*args, "--tensor_parallel_size=2"]) == tp2  # as vLLM reads it


def test_a_store_split_the_engine_cannot_hold_whole_shares_of_is_refused():
    assert shares_per_rank(None, 2, 1, 8, blend=False) == 1
    assert shares_per_rank(4, 1, 1, 8, blend=False) == 4
    assert shares_per_rank(4, 2, 1, 8, blend=False) == 2
    for args, message in [
        ((2, 4, 1, 8, False), "store_tp: 2 is not a multiple of this engine's tensor_parallel_size 4"),
        ((4, 2, 2, 8, False), "store_tp: shares of a different TP need pipeline_parallel_size 1, got 2"),
        ((4, 1, 1, 6, False), "store_tp: the model's 6 KV heads do not split into 4 equal shares"),
        ((2, 1, 1, 8, True), "store_tp: blend needs store_tp equal"),
    ]:
        with pytest.raises(ConfigError, match=message):
            shares_per_rank(*args[:4], blend=args[4])
    with pytest.raises(ConfigError, match="store_tp: a model with multi-head latent attention"):
        shares_per_rank(2, 1, 1, 128, blend=False, mla=True)


def test_health_carries_the_pairing_identity(monkeypatch):
    monkeypatch.setenv(IDENTITY_ENV, "abc123")
    sent: list[dict] = []

    async def engine(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b""})

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(HealthMiddleware(engine)({"type": "http", "path": "/health", "method": "GET"}, None, send))
    assert (b"x-ucm-kv-identity", b"abc123") in sent[0]["headers"]
