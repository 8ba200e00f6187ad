"""The CPU runtime image (``ucm/runtime:<version>-cpu``, built by ``make images-offline``) serving
for real: two containers run ``ucm serve`` (vLLM's CPU build, the tiny model mounted read-only, one
store directory mounted into both) as prefill and decode, the proxy image routes between them, and
the PD answer equals a plain vLLM's on the host. Every container runs as the image's non-root user
on a read-only root filesystem with /tmp writable, as the chart runs them."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.images.test_images import docker
from ucm import __version__
from ucm.deploy.local import LocalStack, Process, default_spec
from ucm.deploy.spec import UCMDeploymentSpec
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer

pytestmark = [pytest.mark.slow, pytest.mark.engines]
RUNTIME = f"ucm/runtime:{__version__}-cpu"
PROXY = f"ucm/proxy:{__version__}"
# What `ucm up` gives an engine besides its role's own environment (vLLM's CPU settings).
ENGINE_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "GLOG_minloglevel")


def run_args(p: Process, mounts: list[str]) -> list[str]:
    """``docker run`` for one role of the local plan: its command and environment, host network,
    the run directory and model at the paths the plan names."""
    env = {k: v for k, v in p.env.items() if k in ENGINE_ENV or k in p.role.env or k in p.role.secret_env}
    image, command = (RUNTIME, p.role.command[1:]) if p.role.command[0] == "ucm" else (PROXY, p.role.command[1:])
    volumes = [arg for m in mounts for arg in ("-v", m)]
    environment = [arg for k, v in env.items() for arg in ("-e", f"{k}={v}")]
    return [
        # /tmp with exec, as an emptyDir is: torch.compile loads the kernels it builds there.
        "run", "-d", "--network", "host", "--read-only", "--tmpfs", "/tmp:exec", "--shm-size", "1g",
        "--name", f"ucm-test-{p.role.name}", *volumes, *environment, image, *command,
    ]  # fmt: skip


@contextlib.contextmanager
def containers(stack: LocalStack, mounts: list[str]) -> Iterator[list[str]]:
    ids: list[str] = []
    try:
        for p in stack.processes:
            docker("rm", "-f", f"ucm-test-{p.role.name}", check=False)
            ids.append(docker(*run_args(p, mounts)).strip())
        yield ids
    finally:
        for cid in ids:
            print(docker("logs", "--tail", "60", cid, check=False))
            docker("rm", "-f", cid, check=False)


def wait_healthy(url: str, ids: list[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        for cid in ids:
            assert docker("inspect", "-f", "{{.State.Running}}", cid).strip() == "true", docker("logs", cid)
        assert time.monotonic() < deadline, f"{url} not healthy in {timeout} s"
        time.sleep(1)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """Mounted into the containers at the same path: not under /tmp, which is their own tmpfs."""
    path = Path(tempfile.mkdtemp(prefix="ucm-runtime-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_pd_through_runtime_containers_equals_plain_vllm(tiny_model: Path, shared_dir: Path, plain: VLLMServer):
    model = shutil.copytree(tiny_model, shared_dir / "model")  # the cache's parents are root's alone
    run = shared_dir / "run"
    stack = LocalStack(UCMDeploymentSpec.model_validate(default_spec(model)), run)
    stack.write_files()
    # The containers' users (1000 for engines, 65532 for the proxy) are not this test's (root):
    # the run directory is theirs to read, the store theirs to write.
    for path in [shared_dir, run, *run.rglob("*"), model, *model.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o644)
    mounts = [f"{run}:{run}", f"{model}:{model}:ro"]
    with containers(stack, mounts) as ids:
        for p in stack.processes:
            wait_healthy(f"http://127.0.0.1:{p.port}", ids)
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        pd = httpx.post(stack.base_url + "/completions", json=body, timeout=120)
        reference = httpx.post(plain.url + "/v1/completions", json=body, timeout=120)
        assert pd.status_code == 200, pd.text
        assert pd.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
        blocks = [f for f in (run / "kv").rglob("*") if f.is_file()]
        assert blocks, "the prefill container saved no block to the shared store"
