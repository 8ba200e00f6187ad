"""Pools split differently, locally: ``ucm up -f`` a spec whose prefill engine runs TP=2 and whose
decode engine runs TP=1. The plan gives both pools ``store_tp: 2`` (the larger TP), so prefill's two
ranks each write their share of a block and decode's one rank reads both; the proxy pairs the two
(their pairing identities carry ``store_tp``, not their own TP) and the answer through PD is a plain
TP=1 engine's (compared as in tests/connector/test_multinode.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.conftest import PROMPT, Stack, running
from e2e.test_stack import metric, post
from tests.connector.test_multinode import BS, CROSS_TP, same_greedy_answer
from ucm.deploy.local import default_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def split_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, reference: dict) -> Iterator[Stack]:
    spec = default_spec(tiny_model)
    spec["prefill"] = {"replicas": 1, "parallel": {"tensor": 2}, "resources": {"gpus": 0}}
    spec["decode"] = {"replicas": 1}
    spec["proxy"] = {"config": {**spec["proxy"]["config"], "pd_check": {"interval_s": 0}}}
    with running(Stack(tmp_path_factory.mktemp("split"), spec, name="split")) as s:
        yield s


def test_prefill_tp2_hands_its_kv_to_a_tp1_decode_through_the_store(split_stack: Stack, reference: dict):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 2}
    status, got = post(split_stack.base_url + "/completions", body, timeout=300)
    assert status == 200, got
    decode = split_stack.state()["roles"]["decode-0"]
    blocks = got["usage"]["prompt_tokens"] // BS
    # Decode's one rank loaded both shares of every block prefill's two ranks wrote.
    assert metric(decode["url"], "ucm_connector_loaded_blocks_total") == 2 * blocks
    same_greedy_answer(got, reference, CROSS_TP)
