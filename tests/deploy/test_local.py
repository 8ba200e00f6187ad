"""``ucm up``'s pieces that need no engine: notices, ports, core binding, the state it writes."""

from __future__ import annotations

import socket

import pytest

from ucm.deploy.local import LocalStack, StackError, default_spec, kubernetes_only_fields
from ucm.deploy.spec import UCMDeploymentSpec


def spec(tmp_path, **overrides) -> UCMDeploymentSpec:
    return UCMDeploymentSpec.model_validate({**default_spec(tmp_path), **overrides})


def test_kubernetes_only_fields_are_named(tmp_path):
    s = spec(
        tmp_path,
        image={"repository": "me/runtime"},
        prefill={"replicas": 1, "resources": {"gpus": 2}, "nodeSelector": {"a": "b"}},
        proxy={"replicas": 2, "apiKeySecret": {"name": "k"}},
    )
    assert kubernetes_only_fields(s) == [
        "image.repository",
        "prefill.resources",
        "prefill.nodeSelector",
        "store.pvc (blocks go to the run directory)",
        "proxy.apiKeySecret",
        "proxy.replicas (one proxy runs locally)",
    ]


def test_a_busy_proxy_port_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(StackError, match=r"^--port: \d+ is in use"):
            LocalStack(spec(tmp_path), tmp_path / "run", s.getsockname()[1])


def test_engines_get_their_own_cores_when_there_are_enough(tmp_path, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    stack = LocalStack(spec(tmp_path, prefill={"replicas": 2}, decode={"replicas": 2}), tmp_path / "run")
    binds = [p.env.get("VLLM_CPU_OMP_THREADS_BIND") for p in stack.processes]
    assert binds == ["0-1", "2-3", "4-5", "6-7", None]  # the proxy is not bound
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    stack = LocalStack(spec(tmp_path), tmp_path / "run")
    assert [p.env.get("VLLM_CPU_OMP_THREADS_BIND") for p in stack.processes] == ["0-0", "0-0", None]


def test_pool_env_wins_over_the_defaults(tmp_path):
    s = spec(tmp_path, decode={"env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "4"}]})
    stack = LocalStack(s, tmp_path / "run")
    decode = next(p for p in stack.processes if p.role.component == "decode")
    assert decode.env["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_files_and_state(tmp_path):
    stack = LocalStack(spec(tmp_path), tmp_path / "run", 0)
    stack.write_files()
    assert sorted(f.name for f in (tmp_path / "run").iterdir()) == [
        "kv",
        "kv-transfer-config.json",
        "logs",
        "proxy.yaml",
    ]
    assert stack.base_url.startswith("http://127.0.0.1:") and stack.base_url.endswith("/v1")
    assert stack.state()["roles"] == {}  # nothing started


def test_the_proxy_judges_its_options_before_anything_starts(tmp_path):
    stack = LocalStack(spec(tmp_path, proxy={"config": {"routing": {"decode": "fastest"}}}), tmp_path / "run")
    with pytest.raises(StackError, match=r"^proxy.config: ucm-proxy refuses it: proxy.routing.decode: Input should be"):
        stack.start(lambda *_: None)
    assert all(p.popen is None for p in stack.processes)
