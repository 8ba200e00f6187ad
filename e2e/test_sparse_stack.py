"""Sparse attention on the PD path: ``ucm up -f`` a spec with ``sparse``; the plan gives it to the
decode engine only. Prefill computes the prompt densely and writes its blocks; decode loads them
from the store, moves each request's middle blocks to its host arena (``offloadBlocks``) and
decodes with ESA over 30% of the blocks — the same tokens a standalone engine with the same
selection (no off-load: it needs UCMConnector) decodes from KV it computed itself."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.conftest import Stack, running
from e2e.test_stack import metric, post, text_of
from ucm.deploy.local import default_spec
from ucm.deploy.spec import SparseSpec
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer

pytestmark = pytest.mark.slow
# dense_layers 0: the tiny model has two layers, which the default would keep dense.
SPARSE = {
    "algorithm": "esa",
    "min_tokens": 64,
    "dense_layers": 0,
    "esa": {"sparse_ratio": 0.3, "min_blocks": 1, "local_window_sz": 1},
}
# The same settings as a resource spells them (camelCase), with off-load.
SPARSE_SPEC = SparseSpec.model_validate({**SPARSE, "offload_blocks": 64}).model_dump(
    mode="json", by_alias=True, exclude_unset=True
)


@pytest.fixture(scope="module")
def sparse_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    spec = {**default_spec(tiny_model), "sparse": SPARSE_SPEC}
    # The tests count decode's sparse requests: the proxy's PD path check would add its own.
    spec["proxy"] = {"config": {**spec["proxy"]["config"], "pd_check": {"interval_s": 0}}}
    with running(Stack(tmp_path_factory.mktemp("sparse"), spec, name="sparse")) as s:
        yield s


@pytest.fixture(scope="module")
def standalone(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    args = ["--served-model-name", "tiny", "--additional-config", json.dumps({"sparse": SPARSE})]
    server = VLLMServer(
        tiny_model, tmp_path_factory.mktemp("standalone") / "vllm.log", extra_args=args, threads_bind="1"
    )
    server.env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="ucm-metrics-")
    try:
        yield server.start().wait_ready()
    finally:
        server.stop()


def test_pd_with_sparse_decode_answers_as_a_sparse_engine_does(sparse_stack: Stack, standalone: VLLMServer):
    roles = sparse_stack.state()["roles"]
    decode, prefill = roles["decode-0"]["url"], roles["prefill-0"]["url"]
    loaded = metric(decode, "ucm_connector_loaded_blocks_total")
    for prompt in PROMPTS[:3]:
        # ignore_eos: a random tiny model may end early; the comparison below is the check.
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        status, got = post(sparse_stack.base_url + "/completions", body)
        assert status == 200, got
        assert got["usage"]["completion_tokens"] == 16
        status, want = post(standalone.url + "/v1/completions", body)
        assert text_of(got) == text_of(want), prompt
    assert metric(decode, "ucm_connector_loaded_blocks_total") > loaded  # the prompt came through the store
    assert metric(decode, "ucm_sparse_requests_total") == 3
    assert metric(decode, "ucm_connector_sparse_offloaded_blocks_total") > 0  # off-loaded, and the same tokens
    attended = metric(decode, "ucm_sparse_blocks_attended_total")
    available = metric(decode, "ucm_sparse_blocks_available_total")
    assert 0 < attended < 0.75 * available  # it read a fraction of the KV
    assert metric(prefill, "ucm_sparse_requests_total") == 0  # prefill stays dense
