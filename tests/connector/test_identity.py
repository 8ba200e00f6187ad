"""Block ids name the weights, not only the model's name: other weights under the same name (or
at the same path) never share blocks; the same weights at another path do. Parallel layouts are
bound into keys, or refused."""

from __future__ import annotations

import asyncio
import json
import shutil
import types

import pytest
from safetensors.numpy import load_file, save_file

from ucm.config import ConfigError
from ucm.hashing import BlockHasher, HashContext
from ucm.integration.vllm.config import blend_overrides, check_parallel_layout, shares_per_rank
from ucm.integration.vllm.health import IDENTITY_ENV, HealthMiddleware
from ucm.integration.vllm.identity import Adapters, engine_identity, pairing_identity, weights_fingerprint
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


# -- what an engine changes beyond its checkpoint ------------------------------------------------------
@pytest.fixture(scope="module")
def model_config(tiny_model):
    """vLLM's own ModelConfig and CacheConfig of the demo model, built as the engine builds them
    (with UCM's plugin loaded, as in every engine process: it registers Blend's model class)."""
    from vllm.config import CacheConfig, ModelConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()

    def build(cache: dict | None = None, **fields):  # type: ignore[no-untyped-def]
        return ModelConfig(model=str(tiny_model), **{"dtype": "float32", **fields}), CacheConfig(**(cache or {}))

    return build


def test_a_plain_engine_changes_nothing_its_ids_do_not_already_name(model_config):
    assert engine_identity(*model_config()) == ""
    # settings that leave the KV of given tokens as it is
    assert engine_identity(*model_config(served_model_name="chat", max_model_len=1024, seed=7)) == ""
    # UCM's Blend class computes what vLLM's Llama does: a blending prefill pairs with a plain decode
    assert engine_identity(*model_config(hf_overrides=blend_overrides())) == ""


def test_overrides_quantization_and_layers_name_other_kv(model_config, tiny_model, tmp_path):
    plain = engine_identity(*model_config())
    variants = [
        engine_identity(*model_config(hf_overrides={"rms_norm_eps": 0.5})),
        engine_identity(*model_config(hf_overrides={"rms_norm_eps": 0.25})),
        engine_identity(*model_config(hf_overrides={"rope_theta": 20000.0})),
        engine_identity(*model_config(dtype="bfloat16", quantization="fp8")),
        engine_identity(*model_config(disable_sliding_window=True)),
        engine_identity(*model_config(hf_config_path=str(tiny_model))),
        engine_identity(*model_config(cache={"kv_cache_dtype_skip_layers": ["0"]})),
    ]
    assert len({plain, *variants}) == len(variants) + 1
    # the same overrides written otherwise are the same setting
    spaced = {"rope_theta": 20000.0, "rms_norm_eps": 0.5}
    assert engine_identity(*model_config(hf_overrides=spaced)) == engine_identity(
        *model_config(hf_overrides=dict(reversed(spaced.items())))
    )


def test_an_override_given_as_a_function_cannot_be_named():
    model = types.SimpleNamespace(hf_overrides=lambda config: config)
    with pytest.raises(ConfigError, match="hf_overrides: a function cannot be named in block ids"):
        engine_identity(model, types.SimpleNamespace(kv_cache_dtype_skip_layers=[]))


def test_an_adapter_is_named_by_its_files_and_the_engines_lora_settings(tmp_path):
    from ucm.deploy.demo_model import TINY
    from ucm_testing.adapters import ensure_adapter

    a1, a2 = ensure_adapter(TINY, 1, tmp_path), ensure_adapter(TINY, 2, tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(a1, copy)

    def identity(path, lora_config=None, name="ad"):  # type: ignore[no-untyped-def]
        return Adapters(lora_config).identity(types.SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path)))

    assert identity(a1) == identity(copy, name="another-name")  # content, not name or path
    assert identity(a1) != identity(a2)
    settings = types.SimpleNamespace(lora_dtype="bfloat16", target_modules=None)
    assert identity(a1, settings) != identity(a1)  # the adapter computed in another dtype
    assert identity(tmp_path / "missing") is None
    assert identity("org/adapter") is None  # a hub id: nothing here to fingerprint


def test_engines_pair_only_when_they_change_kv_alike():
    store = {"spec": "posix", "posix": {"roots": ["/kv"]}}
    args = ["--model", "/models/llama", "--block-size", "32"]
    plain = pairing_identity({"store": store}, args)
    for extra in (
        ["--hf-overrides", '{"rms_norm_eps": 0.5}'],
        ["-q", "fp8"],
        ["--quantization=fp8"],
        ["--enable-lora", "--lora-modules", "ad=/adapters/ad"],
        ["--disable-sliding-window"],
        ["--lora-dtype", "bfloat16"],
    ):
        assert pairing_identity({"store": store}, [*args, *extra]) != plain, extra
    served = ["--enable-lora", "--lora-modules", "ad=/adapters/ad"]
    assert pairing_identity({"store": store}, [*args, *served]) != pairing_identity(
        {"store": store}, [*args, *served, "bd=/adapters/bd"]
    )  # a decode must serve every adapter its prefill does
    overrides = pairing_identity({"store": store}, [*args, "--hf-overrides", '{"a": 1, "b": 2}'])
    assert pairing_identity({"store": store}, [*args, '--hf_overrides={ "b":2,"a":1 }']) == overrides
    # Blend's model class is no change of KV (a blending prefill pairs with its plain decode)
    blend = json.dumps(blend_overrides())
    assert pairing_identity({"store": store}, [*args, "--hf-overrides", blend]) == plain
