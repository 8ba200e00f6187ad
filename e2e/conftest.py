"""One local PD stack (``ucm up``, as a user runs it) and one plain vLLM, shared by the e2e tests.

Three vLLM CPU engines share the machine's cores, each with its OpenMP threads bound explicitly
(``VLLM_CPU_OMP_THREADS_BIND``); they start once per session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from ucm.deploy.local import default_spec, start_time
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer

UCM = str(Path(sys.executable).parent / "ucm")


class Stack:
    """A running ``ucm up`` process and what it printed."""

    def __init__(self, run_dir: Path, spec: dict[str, Any], name: str = "e2e", args: tuple[str, ...] = ()) -> None:
        self.run_dir, self.name = run_dir, name
        spec_file = run_dir / f"{name}.yaml"
        spec_file.write_text(yaml.safe_dump({"apiVersion": "ucm.io/v1alpha1", "kind": "UCMDeployment", "spec": spec}))
        self.proc = subprocess.Popen(
            [UCM, "up", "-f", str(spec_file), "--port", "0", "--run-dir", str(run_dir), "--name", name, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float = 420.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            urls = [line.split("OpenAI base URL: ", 1)[1] for line in self.lines if "OpenAI base URL: " in line]
            if urls:
                return urls[-1]
            if self.proc.poll() is not None:
                raise AssertionError(f"ucm up exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.5)
        raise AssertionError(f"ucm up not ready after {timeout} s:\n{self.output()}")

    def state(self) -> dict[str, Any]:
        return json.loads((self.run_dir / self.name / "stack.json").read_text())

    def down(self) -> int:
        subprocess.run([UCM, "down", "--run-dir", str(self.run_dir), "--name", self.name], check=True, timeout=120)
        return self.proc.wait(60)


def alive(pid: int) -> bool:
    return start_time(pid) is not None  # a zombie has ended: dead for our purposes


PROMPT = PROMPTS[2]  # the prompt the tensor-parallel stacks answer


@pytest.fixture(scope="session")
def reference(plain: VLLMServer) -> dict:
    """A TP=1 engine's answer to PROMPT: the session's plain vLLM (idle while the stacks serve)."""
    return plain.complete(PROMPT, max_tokens=16, logprobs=2, model="tiny")


@contextmanager
def running(stack: Stack) -> Iterator[Stack]:
    """The stack once ready; on exit, ``ucm down`` must stop it and every process it started."""
    try:
        stack.base_url = stack.wait_ready()  # type: ignore[attr-defined]
        yield stack
    finally:
        if stack.proc.poll() is None:
            roles = stack.state()["roles"].values()
            pids = [p["pid"] for r in roles for p in [r, *r.get("workers", [])]]
            assert stack.down() == 0, stack.output()
            assert not [p for p in pids if alive(p)], "ucm down left processes behind"
        print(stack.output())


@pytest.fixture(scope="module")  # e2e/test_stack.py's: its engines gone when it is done
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("stack")
    spec = default_spec(tiny_model)
    # Where prefill's scheduler records a stuck store (ucm serve picks a fresh file otherwise).
    spec["prefill"]["env"] = [{"name": "UCM_STORE_HEALTH_FILE", "value": str(run_dir / "prefill-store.json")}]
    with running(Stack(run_dir, spec)) as s:
        yield s


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention ``text`` (a run directory)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd and proc.name.isdigit() and alive(int(proc.name)):
            out.append(cmd)
    return out


def kill_role(stack: Stack, role: str) -> int:
    pid = stack.state()["roles"][role]["pid"]
    os.killpg(pid, signal.SIGKILL)
    return pid
