"""The same path with Mooncake as the store: ``ucm up`` runs the master from the plan, both engines
join its DRAM pool, and decode loads the prompt's blocks from it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.conftest import Stack, running
from e2e.test_stack import BLOCK, metric, post, text_of
from ucm.deploy.local import default_spec
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mooncake_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    spec = default_spec(tiny_model)
    spec["store"] = {"type": "mooncake", "mooncake": {"master": {}, "segmentSize": "256Mi"}}
    with running(Stack(tmp_path_factory.mktemp("mooncake"), spec, name="mooncake")) as s:
        yield s


def test_pd_through_mooncake_equals_plain_vllm(mooncake_stack: Stack, plain: VLLMServer):
    roles = mooncake_stack.state()["roles"]
    assert "mooncake-master" in roles
    decode = roles["decode-0"]["url"]
    for prompt in PROMPTS[6:8]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        before = metric(decode, "ucm_connector_loaded_blocks_total")
        status, want = post(plain.url + "/v1/completions", body)
        assert status == 200
        status, got = post(mooncake_stack.base_url + "/completions", body)
        assert status == 200, got
        assert text_of(got) == text_of(want)
        assert metric(decode, "ucm_connector_loaded_blocks_total") - before >= len(prompt) // 8 // BLOCK
