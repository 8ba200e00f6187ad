"""``ucm up`` refuses clearly and leaves nothing running."""

from __future__ import annotations

import socket
import subprocess

import pytest

from e2e.conftest import UCM, Stack, processes_mentioning
from ucm.deploy.local import default_spec


def test_a_missing_model_directory_is_named(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "spec:\n  model: {source: {hostPath: /no/such/model}}\n  store: {type: posix, pvc: {claimName: x}}\n"
    )
    r = subprocess.run(
        [UCM, "up", "-f", str(spec), "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert "model.source.hostPath: /no/such/model is not a directory" in r.stderr


def test_a_busy_port_is_named(tiny_model, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [UCM, "up", "--port", str(port), "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=120
        )
    assert r.returncode == 2 and f"--port: {port} is in use" in r.stderr


def test_a_bad_spec_names_the_field(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("spec:\n  model: {source: {hf: x}}\n  store: {type: tape}\n")
    r = subprocess.run(
        [UCM, "up", "-f", str(spec), "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "spec.store.type" in r.stderr


@pytest.mark.slow
def test_an_engine_that_cannot_start_stops_the_stack(tiny_model, tmp_path):
    spec = default_spec(tiny_model)
    spec["model"]["extraArgs"] = ["--no-such-vllm-flag"]
    stack = Stack(tmp_path, spec, name="broken")
    code = stack.proc.wait(240)
    out = stack.output()
    assert code == 1, out
    assert "exited with code" in out and "before it was ready" in out and "--no-such-vllm-flag" in out
    assert processes_mentioning(str(tmp_path)) == []
