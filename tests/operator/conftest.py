"""The operator on kmock. Every test's operator calls are checked against the chart's ClusterRole."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import yaml

from ucm_testing.kmock_operator import Driver, allowed, declare

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ucm-operator"


def run_helm(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """The venv's helm, its cache, config and data under ``tmp``."""
    env = {**os.environ, **{f"HELM_{k}_HOME": str(tmp / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}
    return subprocess.run([str(Path(sys.executable).parent / "helm"), *args], capture_output=True, text=True, env=env)


def helm(*args: str, tmp: Path) -> str:
    r = run_helm(*args, tmp=tmp)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="session")
def cluster_role_rules(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    docs = list(yaml.safe_load_all(helm("template", "r", str(CHART), tmp=tmp_path_factory.mktemp("helm"))))
    role = next(d for d in docs if d and d["kind"] == "ClusterRole")
    # And the Role for the leader election's Lease (in the release's namespace only).
    lease = next(d for d in docs if d and d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election"))
    return [*role["rules"], *lease["rules"]]


@pytest_asyncio.fixture
async def cluster(kmock, cluster_role_rules) -> AsyncIterator[Driver]:
    declare(kmock)
    driver = Driver(str(kmock.url))
    try:
        yield driver
    finally:
        await driver.close()
    denied = sorted({c[:3] for c in kmock.calls if not allowed(cluster_role_rules, *c[:3])})
    assert not denied, f"calls the chart's ClusterRole does not allow: {denied}"
