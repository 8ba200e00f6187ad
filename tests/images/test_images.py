"""The operator and proxy images as the chart runs them: built by ``make images-offline`` (which
``make test`` runs first), started with ``docker run`` as their non-root user on a read-only root
filesystem, and used for real — the proxy routes a PD request between engines on the host, the
operator reconciles a ``UCMDeployment`` on a kmock API server on the host network."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.operator.test_operator import CHILDREN, NS, SPEC, eventually
from ucm import __version__
from ucm.deploy.kubernetes import RUNTIME_UID
from ucm.deploy.ports import free_port
from ucm_testing.fake_vllm import MODEL, FakeVLLMThread
from ucm_testing.kmock_operator import Emulator

IMAGES = {
    "proxy": f"ucm/proxy:{__version__}",
    "operator": f"ucm/operator:{__version__}",
    "runtime-cpu": f"ucm/runtime:{__version__}-cpu",
}
# The users the operator runs them as (RUNTIME_UID for engines).
UIDS = {"proxy": 65532, "operator": 65532, "runtime-cpu": RUNTIME_UID}


def docker(*args: str, check: bool = True) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    assert not check or r.returncode == 0, f"docker {' '.join(args)}: {r.stderr}"
    return r.stdout


@contextlib.contextmanager
def container(image: str, *args: str, mounts: tuple[str, ...] = ()) -> Iterator[str]:
    """The image run as the chart runs it: its own non-root user, read-only root, /tmp writable."""
    volumes = [arg for m in mounts for arg in ("-v", m)]
    cid = docker("run", "-d", "--network", "host", "--read-only", "--tmpfs", "/tmp", *volumes, image, *args).strip()
    try:
        yield cid
    finally:
        logs = docker("logs", cid, check=False)
        docker("rm", "-f", cid, check=False)
        print(logs)  # shown when the test fails


@pytest.mark.parametrize("name", IMAGES)
def test_each_image_is_built_and_runs_as_non_root(name):
    config = json.loads(docker("image", "inspect", IMAGES[name]))[0]["Config"]
    uid = UIDS[name]
    assert config["User"] == f"{uid}:{uid}"
    out = docker("run", "--rm", "--network", "none", "--read-only", "--entrypoint", "id", IMAGES[name])
    assert out.startswith(f"uid={uid}(")  # a named user: vLLM, torch and Kopf look it up


def test_the_cpu_runtime_image_runs_mooncakes_master_and_client():
    """An all-CPU deployment's Mooncake master runs this image (ucm.deploy.kubernetes), and its
    engines load Mooncake's client: both link libibverbs, even over TCP."""
    image = IMAGES["runtime-cpu"]
    run = ("run", "--rm", "--network", "none", "--read-only", "--entrypoint")
    assert docker(*run, "mooncake_master", image, "--version").strip()
    docker(*run, "python3", image, "-c", "from mooncake.store import MooncakeDistributedStore")


def test_the_proxy_image_routes_a_pd_request_to_engines_on_the_host(tmp_path: Path):
    fakes = FakeVLLMThread()
    try:
        prefill, decode = fakes.add("p"), fakes.add("d")
        port = free_port()
        (tmp_path / "proxy.yaml").write_text(
            json.dumps({"host": "127.0.0.1", "port": port, "prefill": [prefill.url], "decode": [decode.url]})
        )
        tmp_path.chmod(0o755)
        (tmp_path / "proxy.yaml").chmod(0o644)
        with container(IMAGES["proxy"], "--config", "/etc/ucm/proxy.yaml", mounts=(f"{tmp_path}:/etc/ucm:ro",)):
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the proxy container did not answer /health"
                time.sleep(0.2)
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert decode.requests[0]["body"]["kv_transfer_params"]["prefilled_by"] == "p"
    finally:
        fakes.close()


@pytest.mark.kmock(cls=Emulator)
@pytest.mark.asyncio
async def test_the_operator_image_reconciles_on_a_kmock_api_server(kmock, cluster):
    with container(IMAGES["operator"], "--server", cluster.url, "--liveness", ""):
        await cluster.apply_ucmd(NS, "a", SPEC, uid="uid-a")

        async def created() -> None:
            assert set(await cluster.children(NS, "a")) == CHILDREN

        await eventually(created, timeout=60)
