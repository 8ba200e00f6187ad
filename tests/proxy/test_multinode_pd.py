"""PD through the proxy between two engines that are each spread over two processes (TP=2 with
vLLM's ``--nnodes 2`` on loopback: the commands the operator renders for a LeaderWorkerSet's pods):
the prefill engine's ranks each write their share of the prompt's blocks, the decode engine's ranks
each load theirs, and the answer is a TP=1 engine's (greedy tokens compared as in
tests/connector/test_multinode.py: equal up to a near tie flipped by the order of the sums)."""

from __future__ import annotations

import json

import pytest

from tests.connector.test_multinode import BS, MODEL, same_greedy_answer
from ucm.integration.vllm.config import kv_transfer_config
from ucm_testing.engine_group import EngineGroup
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer

pytestmark = pytest.mark.slow


def test_pd_between_two_multi_node_engines_answers_as_one_engine(tiny_model, tmp_path, make_proxy):
    logs, store = tmp_path / "logs", tmp_path / "kv"
    logs.mkdir()
    store.mkdir()
    kv_config = tmp_path / "kv-transfer-config.json"
    kv_config.write_text(json.dumps(kv_transfer_config({"spec": "posix", "posix": {"roots": [str(store)]}})))
    prompt = PROMPTS[2]
    reference = VLLMServer(tiny_model, logs / "tp1.log", threads_bind="0-1").start()
    try:
        want = reference.wait_ready().complete(prompt, max_tokens=16, logprobs=2)
    finally:
        reference.stop()

    def engine(name: str) -> EngineGroup:
        return EngineGroup(tiny_model, kv_config, logs, name, model_spec=MODEL, tensor=2, nodes=2, cores=["0", "1"])

    with engine("prefill") as prefill, engine("decode") as decode:
        proxy = make_proxy(prefill=[prefill.url], decode=[decode.url])
        body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "logprobs": 2}
        with proxy.client(timeout=120) as c:
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        blocks = got["usage"]["prompt_tokens"] // BS
        # The decode engine loaded every block the prefill wrote (what vLLM says it gave the request
        # from the connector), each of its two ranks its own share of each.
        assert got["kv_transfer_params"]["ucm_loaded_tokens"] == blocks * BS
        assert decode.metrics()["ucm_connector_loaded_blocks_total"] == 2 * blocks
        same_greedy_answer(got, want)
