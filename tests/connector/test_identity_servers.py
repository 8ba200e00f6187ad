"""Never the wrong KV: engines that differ in what changes a block's bytes share one store and
still answer as a fresh engine does, loading only what is truly the same KV.

Five real vLLM servers (CPU build) for the module. P serves without a store: the reference, for
the base model, adapter A1 (``ad``), adapter A2 (``ad2``) and prompt embeddings. On one posix
store: X serves A1 as ``ad``; Y the base model alone; Z serves A2 under the same name ``ad`` and a
copy of A1 at another path as ``same``; O the base model with ``--hf-overrides``. Each test uses
prompts its engines have not seen, so their own prefix caches cannot answer: hits come from the
store or not at all.

Not here: two engines differing in ``--quantization`` — vLLM's CPU build quantizes nothing on the
fly (fp8 needs CUDA ops); the setting's place in the block id is tested on vLLM's own ModelConfig
in ``test_identity.py``.
"""

from __future__ import annotations

import base64
import io
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from ucm.deploy.demo_model import TINY
from ucm.integration.vllm.config import kv_transfer_config
from ucm_testing.adapters import ensure_adapter
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer, cached_tokens, serving

pytestmark = [pytest.mark.slow, pytest.mark.engines]
BS = 32
MAX_TOKENS = 24
LORA = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
HIT = "ucm_connector_external_hit_tokens_total"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    a1, a2 = ensure_adapter(TINY, 1, root), ensure_adapter(TINY, 2, root)
    copy = root / "copy-of-a1"
    shutil.copytree(a1, copy)
    return {"a1": a1, "a2": a2, "a1_copy": copy}


@pytest.fixture(scope="module")
def servers(tiny_model, adapters, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    store = {"spec": "posix", "posix": {"roots": [str(tmp_path_factory.mktemp("kv-store"))]}}
    kv = kv_transfer_config(store, "kv_both")
    a1, a2, copy = adapters["a1"], adapters["a2"], adapters["a1_copy"]
    embeds = "--enable-prompt-embeds"
    args = {
        "P": [*LORA, "--lora-modules", f"ad={a1}", f"ad2={a2}", embeds],
        "X": [*LORA, "--lora-modules", f"ad={a1}", embeds],
        "Y": [],
        "Z": [*LORA, "--lora-modules", f"ad={a2}", f"same={copy}"],
        "O": ["--hf-overrides", '{"rms_norm_eps": 0.5}'],
    }
    engines = {
        name: VLLMServer(
            tiny_model, logs / f"{name}.log", kv_transfer_config=None if name == "P" else kv, extra_args=extra
        )
        for name, extra in args.items()
    }
    with serving(*engines.values()):
        yield engines


def answer(server: VLLMServer, prompt: str, model: str | None = None) -> tuple[str, int, float]:
    """Greedy text, the prompt tokens vLLM reports cached, and the tokens the store gave."""
    before = server.metrics().get(HIT, 0.0)
    body = {"model": model} if model else {}
    r = server.complete(prompt, max_tokens=MAX_TOKENS, **body)
    return r["choices"][0]["text"], cached_tokens(r), server.metrics().get(HIT, 0.0) - before


def full_block_tokens(server: VLLMServer, prompt: str) -> int:
    n = len(server.post("/tokenize", {"model": server.model, "prompt": prompt})["tokens"])
    return min(n // BS * BS, n - 1)  # vLLM computes at least one token


def test_an_adapters_kv_is_never_served_to_the_base_model(servers):
    P, X, Y = servers["P"], servers["X"], servers["Y"]
    prompt = PROMPTS[0]
    with_adapter, _, _ = answer(X, prompt, "ad")
    assert with_adapter == answer(P, prompt, "ad")[0]
    base = answer(P, prompt)[0]
    assert base != with_adapter  # the adapter changes the answer: a wrong load would show
    text, cached, loaded = answer(Y, prompt)
    assert (text, cached, loaded) == (base, 0, 0)


def test_the_base_models_kv_is_never_served_to_an_adapter(servers):
    P, X, Y = servers["P"], servers["X"], servers["Y"]
    prompt = PROMPTS[1]
    answer(Y, prompt)  # stored under the base model's ids
    text, cached, loaded = answer(X, prompt, "ad")
    assert (text, cached, loaded) == (answer(P, prompt, "ad")[0], 0, 0)


def test_two_adapters_of_one_name_with_other_weights_share_nothing(servers):
    P, X, Z = servers["P"], servers["X"], servers["Z"]
    prompt = PROMPTS[2]
    answer(X, prompt, "ad")  # A1's KV, stored
    expected = answer(P, prompt, "ad2")[0]  # A2's answer
    assert expected != answer(P, prompt, "ad")[0]
    text, cached, loaded = answer(Z, prompt, "ad")  # Z's "ad" is A2
    assert (text, cached, loaded) == (expected, 0, 0)


def test_the_same_adapter_under_another_name_and_path_loads_every_block(servers):
    """Named by content: the copy of A1 that Z serves as ``same`` finds what X stored for ``ad``."""
    P, X, Z = servers["P"], servers["X"], servers["Z"]
    prompt = PROMPTS[3]
    answer(X, prompt, "ad")
    text, cached, loaded = answer(Z, prompt, "same")
    assert text == answer(P, prompt, "ad")[0]
    assert cached == loaded == full_block_tokens(Z, prompt)


def test_a_base_request_batched_with_adapter_requests_runs_no_adapter(servers):
    """vLLM's CPU LoRA ops applied the last adapter slot to base-model tokens of a mixed batch
    (``ucm.integration.vllm.lora_cpu``): wrong answers, and wrong KV stored under base ids."""
    P, Z = servers["P"], servers["Z"]
    for name in ("ad", "same"):  # both of Z's adapter slots hold an adapter
        answer(Z, PROMPTS[8][:200], name)
    prompt = PROMPTS[8]
    with ThreadPoolExecutor(5) as pool:
        adapted = [pool.submit(answer, Z, PROMPTS[i], ("ad", "same")[i % 2]) for i in range(4)]
        base = pool.submit(answer, Z, prompt)
        for request in adapted:
            request.result()
    assert base.result()[0] == answer(P, prompt)[0]


def test_prompt_embeddings_stay_out_of_the_store(servers, tiny_model):
    """Two embedding prompts of one length and other values: the second is computed, not loaded."""
    P, X = servers["P"], servers["X"]
    first, second = (_embeddings(tiny_model, X, PROMPTS[i]) for i in (4, 5))
    assert len(first) == len(second)
    before = X.metrics()
    X.post("/v1/completions", _embeds_body(X, first))
    out = X.post("/v1/completions", _embeds_body(X, second))
    after = X.metrics()
    assert out["choices"][0]["text"] == P.post("/v1/completions", _embeds_body(P, second))["choices"][0]["text"]
    assert cached_tokens(out) == 0
    assert after.get(HIT, 0) == before.get(HIT, 0)
    key = "ucm_connector_bypassed_prompt_embeds_requests_total"
    assert after[key] - before.get(key, 0) == 2


def test_engines_differing_in_hf_overrides_share_nothing(servers):
    P, Y, over = servers["P"], servers["Y"], servers["O"]
    prompt = PROMPTS[6]
    overridden, _, _ = answer(over, prompt)  # stored under the overridden engine's ids
    base = answer(P, prompt)[0]
    assert overridden != base  # the override changes the answer: a wrong load would show
    assert answer(Y, prompt) == (base, 0, 0)
    # and the other way round: the plain engine's blocks are nothing to the overridden one
    prompt = PROMPTS[7]
    answer(Y, prompt)
    text, cached, loaded = answer(over, prompt)
    assert (cached, loaded) == (0, 0)
    assert text != answer(P, prompt)[0]


def _embeddings(model_dir, server: VLLMServer, prompt: str):  # type: ignore[no-untyped-def]
    """The model's own input embeddings of ``prompt``'s tokens, cut to whole blocks: a prompt the
    store could hold, given as numbers rather than tokens."""
    from safetensors.torch import load_file

    table = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    tokens = server.post("/tokenize", {"model": server.model, "prompt": prompt})["tokens"]
    return table[tokens[: 3 * BS]]


def _embeds_body(server: VLLMServer, rows) -> dict:  # type: ignore[no-untyped-def]
    import torch

    buffer = io.BytesIO()
    torch.save(rows.contiguous(), buffer)
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return {"model": server.model, "prompt_embeds": encoded, "max_tokens": MAX_TOKENS, "temperature": 0.0}
