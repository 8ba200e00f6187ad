"""Sparse attention inside real vLLM (CPU build) servers: the plugin puts UCM's backend in place of
vLLM's CPU attention; a budget of every block decodes token-identically to dense vLLM for every
algorithm (the requests really go through the sparse path: its metrics count them); a bad sparse
configuration stops the engine at startup, naming the field.

The session's plain engine as the dense one; one sparse server per algorithm (``--additional-config``: an
engine without UCMConnector), three at a time to keep memory bounded.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import ServerFailed, VLLMServer, serving

pytestmark = [pytest.mark.slow, pytest.mark.engines]
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


# Three sparse servers at a time: they start in about the time of one, and three (~3 GB each) fit
# beside the session's plain engine.
BATCHES = [tuple(sorted(FULL_BUDGET))[:3], tuple(sorted(FULL_BUDGET))[3:]]


@pytest.fixture(scope="module", params=BATCHES, ids="+".join)
def sparse(request, tiny_model, tmp_path_factory):
    """Algorithm -> its sparse server, for one batch of algorithms."""
    servers = {}
    for algorithm in request.param:
        server = VLLMServer(
            tiny_model,
            tmp_path_factory.mktemp("logs") / f"{algorithm}.log",
            extra_args=sparse_args(algorithm, FULL_BUDGET[algorithm]),
            threads_bind="1",
        )
        # Workers count the ucm_sparse_* metrics; the API server sums every process's samples from here.
        server.env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path_factory.mktemp(f"metrics-{algorithm}"))
        servers[algorithm] = server
    with serving(*servers.values()):
        yield servers


def test_a_full_budget_decodes_token_identically_to_dense(plain, sparse):
    for algorithm, server in sparse.items():
        for prompt in PROMPTS[:3]:
            want = plain.complete(prompt, max_tokens=24)["choices"][0]["text"]
            got = server.complete(prompt, max_tokens=24)["choices"][0]["text"]
            assert got == want, (algorithm, prompt)
        m = server.metrics()
        assert m["ucm_sparse_requests_total"] == 3, algorithm  # every prompt (>= 64 tokens) on the sparse path
        assert m["ucm_sparse_blocks_available_total"] > 0, algorithm
        assert m["ucm_sparse_blocks_attended_total"] == m["ucm_sparse_blocks_available_total"], algorithm
        assert m["ucm_sparse_selection_seconds_count"] > 0, algorithm


def test_short_requests_stay_dense(plain, sparse):
    prompt = PROMPTS[4][:40]  # under min_tokens
    want = plain.complete(prompt, max_tokens=8)["choices"][0]["text"]
    for algorithm, server in sparse.items():
        before = server.metrics()["ucm_sparse_requests_total"]
        assert server.complete(prompt, max_tokens=8)["choices"][0]["text"] == want, algorithm
        assert server.metrics()["ucm_sparse_requests_total"] == before, algorithm


def test_a_bad_sparse_config_stops_the_engine_naming_the_field(tiny_model, tmp_path):
    """One engine start: a limit only the loaded model can check (hash bits over its head dim). The
    checks that need no model run below through the same function the engine calls at startup."""
    args = sparse_args("gsa_ondevice", {"hash_bits": 256})
    server = VLLMServer(tiny_model, tmp_path / "bad.log", extra_args=args, threads_bind="1")
    try:
        with pytest.raises(ServerFailed) as failed:
            server.start().wait_ready()
    finally:
        server.stop()
    assert "sparse.gsa_ondevice.hash_bits" in str(failed.value)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"sparse": {"algorithm": "esa", "esa": {"sparse_ratio": 0}}}, "additional_config.sparse.esa.sparse_ratio"),
        ({"ucm_sparse_config": {"Quest": {}}}, "additional_config.ucm_sparse_config.Quest"),
        (
            {"sparse": {"algorithm": "esa", "dense_layers": 0, "offload_blocks": 64}},
            "additional_config.sparse.offload_blocks: needs UCMConnector",
        ),
    ],
    ids=["out-of-range", "unknown-algorithm", "offload-without-connector"],
)
def test_a_bad_additional_config_is_refused_naming_the_field(extra, field):
    from ucm.config import ConfigError
    from ucm.integration.vllm.attention import configured_sparse

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        configured_sparse(SimpleNamespace(kv_transfer_config=None, additional_config=extra))
