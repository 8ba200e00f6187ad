"""Blend on the PD path: ``ucm up -f`` a spec with ``blend``; the plan gives it to the prefill
engine only (``ucm serve`` runs it with UCM's Blend model class). Passages are cached by sending
each alone through the proxy; a prompt that places them in another order is blended by prefill,
whose blocks reach decode through the store under the blend's ids; the answer is what a plain vLLM
gives (the tiny model's two layers make the default blend exact: see
tests/connector/test_blend_server.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.conftest import Stack, running
from e2e.test_stack import metric, post, text_of
from ucm.deploy.local import default_spec
from ucm.integration.vllm.config import BlendConfig
from ucm_testing.vllm_server import VLLMServer

pytestmark = pytest.mark.slow
BS = 32


@pytest.fixture(scope="module")
def blend_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    spec = {**default_spec(tiny_model), "blend": {}}
    # The tests count the engines' loads: the proxy's PD path check would add its own.
    spec["proxy"] = {"config": {**spec["proxy"]["config"], "pd_check": {"interval_s": 0}}}
    with running(Stack(tmp_path_factory.mktemp("blend"), spec, name="blend")) as s:
        yield s


def words(n: int, seed: int) -> list[int]:
    return [40 + (seed * 7919 + i * 104729) % 460 for i in range(n)]


def test_pd_with_blend_answers_as_plain_vllm(blend_stack: Stack, plain: VLLMServer, tiny_model: Path):
    from transformers import AutoTokenizer

    separator = AutoTokenizer.from_pretrained(str(tiny_model)).encode(BlendConfig().separator, add_special_tokens=False)
    roles = blend_stack.state()["roles"]
    decode, prefill = roles["decode-0"]["url"], roles["prefill-0"]["url"]
    system, first, second, question = words(40, 31), words(100, 32), words(80, 33), words(20, 34)
    for passage in (first, second):  # ingested: each prefilled alone, its blocks in the store
        status, got = post(blend_stack.base_url + "/completions", {"model": "tiny", "prompt": passage, "max_tokens": 1})
        assert status == 200, got
    hits = metric(prefill, "ucm_connector_blend_chunks_hit_total")
    loaded = metric(decode, "ucm_connector_loaded_blocks_total")
    prompt = system + separator + second + separator + first + separator + question
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    status, got = post(blend_stack.base_url + "/completions", body)
    assert status == 200, got
    status, want = post(plain.url + "/v1/completions", body)
    assert text_of(got) == text_of(want)
    assert metric(prefill, "ucm_connector_blend_chunks_hit_total") - hits == 2
    # decode loaded every full block of the prompt: blended ones included, under the blend's ids
    assert metric(decode, "ucm_connector_loaded_blocks_total") - loaded == len(prompt) // BS
    assert metric(decode, "ucm_connector_blend_chunks_hit_total") == 0  # decode does not blend
