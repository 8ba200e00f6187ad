"""Sparse attention inside real vLLM (CPU build) servers: the plugin puts UCM's backend in place of
vLLM's CPU attention; a budget of every block decodes token-identically to dense vLLM for every
algorithm (the requests really go through the sparse path: its metrics count them); a bad sparse
configuration stops the engine at startup, naming the field.

One dense server for the module; one sparse server per algorithm (``--additional-config``: an
engine without UCMConnector), started in turn to keep memory bounded.
"""

from __future__ import annotations

import json
import tempfile

import pytest

from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import ServerFailed, VLLMServer

pytestmark = pytest.mark.slow
FULL_BUDGET = {
    "esa": {"sparse_ratio": 1.0},
    "gsa": {"sparse_ratio": 1.0},
    "gsa_ondevice": {"sparse_ratio": 1.0, "hash_bits": 32},
    "kvstar": {"sparse_ratio": 1.0, "retrieval_stride": 3, "blk_repre_dim_prune_ratio": 0.5},
    "psa": {"eps": 1.0},
    "static": {"sparse_ratio": 1.0},
}


def sparse_args(algorithm: str, options: dict, min_tokens: int = 64) -> list[str]:
    # dense_layers 0: every layer of the tiny model goes through the sparse path
    config = {"sparse": {"algorithm": algorithm, "min_tokens": min_tokens, "dense_layers": 0, algorithm: options}}
    return ["--additional-config", json.dumps(config)]


@pytest.fixture(scope="module")
def dense(tiny_model, tmp_path_factory):
    server = VLLMServer(tiny_model, tmp_path_factory.mktemp("logs") / "dense.log", threads_bind="0")
    try:
        yield server.start().wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module", params=sorted(FULL_BUDGET))
def sparse(request, tiny_model, tmp_path_factory):
    algorithm = request.param
    server = VLLMServer(
        tiny_model,
        tmp_path_factory.mktemp("logs") / f"{algorithm}.log",
        extra_args=sparse_args(algorithm, FULL_BUDGET[algorithm]),
        threads_bind="1",
    )
    # Workers count the ucm_sparse_* metrics; the API server sums every process's samples from here.
    server.env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="ucm-metrics-")
    try:
        yield algorithm, server.start().wait_ready()
    finally:
        server.stop()


def test_a_full_budget_decodes_token_identically_to_dense(dense, sparse):
    algorithm, server = sparse
    for prompt in PROMPTS[:3]:
        want = dense.complete(prompt, max_tokens=24)["choices"][0]["text"]
        got = server.complete(prompt, max_tokens=24)["choices"][0]["text"]
        assert got == want, (algorithm, prompt)
    m = server.metrics()
    assert m["ucm_sparse_requests_total"] == 3  # every prompt (>= 64 tokens) decoded on the sparse path
    assert m["ucm_sparse_blocks_available_total"] > 0
    assert m["ucm_sparse_blocks_attended_total"] == m["ucm_sparse_blocks_available_total"]
    assert m["ucm_sparse_selection_seconds_count"] > 0


def test_short_requests_stay_dense(dense, sparse):
    _, server = sparse
    before = server.metrics()["ucm_sparse_requests_total"]
    prompt = PROMPTS[4][:40]  # under min_tokens
    assert (
        server.complete(prompt, max_tokens=8)["choices"][0]["text"]
        == dense.complete(prompt, max_tokens=8)["choices"][0]["text"]
    )
    assert server.metrics()["ucm_sparse_requests_total"] == before


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (sparse_args("esa", {"sparse_ratio": 0}), "additional_config.sparse.esa.sparse_ratio"),
        (
            ["--additional-config", json.dumps({"ucm_sparse_config": {"Quest": {}}})],
            "additional_config.ucm_sparse_config.Quest",
        ),
        (sparse_args("gsa_ondevice", {"hash_bits": 256}), "sparse.gsa_ondevice.hash_bits"),
    ],
    ids=["out-of-range", "unknown-algorithm", "hash-bits-over-head-dim"],
)
def test_a_bad_sparse_config_stops_the_engine_naming_the_field(tiny_model, tmp_path, args, field):
    server = VLLMServer(tiny_model, tmp_path / "bad.log", extra_args=args, threads_bind="1")
    try:
        with pytest.raises(ServerFailed) as failed:
            server.start().wait_ready()
    finally:
        server.stop()
    assert field in str(failed.value)
