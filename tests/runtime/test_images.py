"""The Dockerfiles, checked without Docker: hadolint, the rules that matter, entrypoints run
outside a container with the image's own arguments, and tags that match what the chart and the
operator reference."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

from ucm import __version__
from ucm.deploy.plan import PROXY_IMAGE, build_plan
from ucm.deploy.ports import free_port
from ucm.deploy.roles import Site
from ucm.deploy.spec import ImageSpec, UCMDeploymentSpec

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "runtime").glob("Dockerfile*"))
BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"use the exec form (a JSON list), not {args!r}"
    return value


def test_there_is_an_image_per_deployable():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cpu", "Dockerfile.operator", "Dockerfile.proxy"]


def test_hadolint_passes():
    r = subprocess.run([str(BIN / "hadolint"), *map(str, DOCKERFILES)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_rules_that_matter(path):
    ins = instructions(path)
    defaults = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    for op, args in ins:
        if op == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), args.split()[0])
            assert ":" in image and not image.endswith(":latest"), f"unpinned base image {image}"
        if op in ("ENV", "ARG"):
            assert not re.search(r"(PASSWORD|SECRET|TOKEN|API_KEY)\w*=", args, re.I), f"a secret in {op} {args}"
        if op == "COPY" and not args.startswith("--from="):  # --from: another stage's files
            *sources, _dest = args.split()
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: not in the build context"
    users = [args for op, args in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must end as a non-root USER"
    entry = exec_form(next(args for op, args in ins if op == "ENTRYPOINT"))
    assert entry[0] in PYPROJECT["project"]["scripts"], f"ENTRYPOINT {entry[0]} is not one of this project's scripts"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoints_run_outside_a_container(path):
    entry = exec_form(next(args for op, args in instructions(path) if op == "ENTRYPOINT"))
    r = subprocess.run([str(BIN / entry[0]), *entry[1:], "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


def test_the_proxy_image_command_serves_health(tmp_path):
    """The proxy image's ENTRYPOINT + CMD, with the config the operator would mount."""
    ins = instructions(ROOT / "runtime" / "Dockerfile.proxy")
    entry = exec_form(next(a for op, a in ins if op == "ENTRYPOINT"))
    cmd = exec_form(next(a for op, a in ins if op == "CMD"))
    spec = UCMDeploymentSpec.model_validate(
        {"model": {"source": {"hf": "m"}}, "store": {"type": "nfs", "nfs": {"server": "s", "path": "/p"}}}
    )
    port = free_port()
    ports = iter([free_port(), free_port(), port])
    plan = build_plan("x", spec, Site("local", config_dir=str(tmp_path), ports=lambda role: next(ports)))
    for name, text in plan.files.items():  # proxy.yaml, and the backends file it names
        (tmp_path / name).write_text(text)
    config = tmp_path / "proxy.yaml"
    (tmp_path / "credentials").mkdir()  # what the operator's Secret (ucm up: a file) provides
    (tmp_path / "credentials" / "backend-api-key").write_text("k" * 32)
    args = [str(config) if a == "/etc/ucm/proxy.yaml" else a for a in cmd]
    proc = subprocess.Popen([str(BIN / entry[0]), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert r.status == 200
                    return
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                time.sleep(0.1)
        raise AssertionError("the proxy never answered /health")
    finally:
        proc.terminate()
        proc.wait(10)


def test_image_tags_agree_with_the_chart_and_the_operator():
    version = PYPROJECT["project"]["version"]
    assert __version__ == version
    built = set(re.findall(r"-t (ucm/[a-z]+):\$\(VERSION\)", (ROOT / "Makefile").read_text()))
    assert built == {"ucm/operator", "ucm/proxy", "ucm/runtime"}
    chart = yaml.safe_load((ROOT / "charts" / "ucm-operator" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "ucm-operator" / "values.yaml").read_text())
    assert chart["appVersion"] == version and values["image"]["tag"] == ""  # "" means appVersion
    assert values["image"]["repository"] in built
    # The engines' default images, by the rendering release: CUDA for pods with GPUs, the CPU flavour without.
    runtime = ImageSpec()
    assert runtime.reference(cpu=False) == f"ucm/runtime:{version}"
    assert runtime.reference(cpu=True) == f"ucm/runtime:{version}-cpu"
    assert "-t ucm/runtime:$(VERSION)-cpu" in (ROOT / "Makefile").read_text()
    assert PROXY_IMAGE in built
