"""An engine larger than one pod, locally: ``ucm up -f`` a spec whose decode engine runs tensor
parallel over two "nodes" (``parallel: {tensor: 2, nodes: 2}``) starts it as the operator's
LeaderWorkerSet would run it — a leader that serves and a headless worker, here two processes on
loopback with a rendezvous port of their own — and supervises the two as one: a worker that dies
takes its leader down with it and the group restarts whole; ``ucm restart`` rolls the group as one
engine; ``ucm down`` stops both.

The answers are a TP=1 engine's (greedy tokens compared as in tests/connector/test_multinode.py: equal
up to a near tie flipped by the order of the sums), through PD: prefill (TP=2 in one process group)
writes each rank's share of the prompt's blocks, the decode group's ranks each load theirs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.conftest import PROMPT, UCM, Stack, alive, running
from e2e.test_stack import metric, post
from tests.connector.test_multinode import BS, same_greedy_answer
from ucm.deploy.local import cpu_share, default_spec, engine_cpus, vllm_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def group_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, reference: dict) -> Iterator[Stack]:
    spec = default_spec(tiny_model)
    # Both pools split a block the same way (TP=2); only decode spreads over two pods. No GPUs: vLLM CPU.
    spec["prefill"] = {"replicas": 1, "parallel": {"tensor": 2}, "resources": {"gpus": 0}}
    spec["decode"] = {"replicas": 1, "parallel": {"tensor": 2, "nodes": 2}, "resources": {"gpus": 0}}
    spec["proxy"] = {"config": {**spec["proxy"]["config"], "pd_check": {"interval_s": 0}}}
    with running(Stack(tmp_path_factory.mktemp("group"), spec, name="group")) as s:
        yield s


def answer(stack: Stack) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 2}
    status, got = post(stack.base_url + "/completions", body, timeout=300)
    assert status == 200, got
    return got


def test_a_two_pod_decode_engine_answers_through_pd_as_one_engine(group_stack: Stack, reference: dict):
    decode = group_stack.state()["roles"]["decode-0"]
    assert len(decode["workers"]) == 1 and alive(decode["workers"][0]["pid"])
    got = answer(group_stack)
    blocks = got["usage"]["prompt_tokens"] // BS
    # Each of decode's two ranks loaded its share of every block prefill wrote.
    assert metric(decode["url"], "ucm_connector_loaded_blocks_total") == 2 * blocks
    same_greedy_answer(got, reference)


def test_a_worker_that_dies_restarts_its_whole_group(group_stack: Stack, reference: dict):
    before = group_stack.state()["roles"]["decode-0"]
    os.killpg(before["workers"][0]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 420
    while True:
        now = group_stack.state()["roles"]["decode-0"]
        if now["restarts"] == before["restarts"] + 1 and now["pid"] != before["pid"]:
            break
        assert time.monotonic() < deadline, group_stack.output()
        time.sleep(0.5)
    assert "decode-0 exited" in group_stack.output()
    assert not alive(before["pid"])  # the leader went with its worker
    assert alive(now["workers"][0]["pid"])
    deadline = time.monotonic() + 420
    while True:  # until the proxy's health check has the new leader back
        status, got = post(
            group_stack.base_url + "/completions",
            {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 2},
            timeout=300,
        )
        if status == 200 and metric(now["url"], "ucm_connector_loaded_blocks_total") > 0:
            break
        assert time.monotonic() < deadline, (status, got)
        time.sleep(2)
    same_greedy_answer(got, reference)


def test_ucm_restart_rolls_a_group_as_one_engine(group_stack: Stack, reference: dict):
    """A new group (leader and worker) starts on a new port and serves before the old one leaves;
    each new process is bound to its own share of the engine's cores, as at ``ucm up``."""
    before = group_stack.state()["roles"]["decode-0"]
    r = subprocess.run(
        [UCM, "restart", "--role", "decode", "--run-dir", str(group_stack.run_dir), "--name", group_stack.name],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr + group_stack.output()
    after = group_stack.state()["roles"]["decode-0"]
    assert after["url"] != before["url"]
    assert not alive(before["pid"]) and not alive(before["workers"][0]["pid"])
    assert len(after["workers"]) == 1 and alive(after["workers"][0]["pid"])
    engines = ["prefill-0", "decode-0"]
    for session, share in zip([after["pid"], after["workers"][0]["pid"]], range(2), strict=True):
        workers = vllm_workers(session)
        threads = [int(t.name) for pid in workers for t in Path(f"/proc/{pid}/task").iterdir()]
        want = frozenset(cpu_share(engine_cpus("decode-0", engines), share, 2))
        assert workers and {frozenset(os.sched_getaffinity(t)) for t in threads} == {want}
    same_greedy_answer(answer(group_stack), reference)
