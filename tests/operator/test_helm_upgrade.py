"""The chart's upgrade path, with the real helm against kmock and the real operator.

The previous layout of this chart carried the UCMDeployment CRD under ``crds/``: Helm installs that
directory once, never upgrades it and never owns it. This chart carries the CRD as a template, so
`helm upgrade` brings the new schema. A cluster installed from the previous layout needs one
command first (docs: the Kubernetes guide's upgrade section) — Helm refuses to take over an object
its release did not create — and then upgrades; the resource written before keeps reconciling,
and `helm uninstall` leaves the CRD and every UCMDeployment.

What kmock cannot do, helm is told to skip: server-side apply and OpenAPI validation (kmock serves
neither), so helm patches client-side (``--server-side=false``), as Helm 3 did.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from tests.operator.conftest import CHART, run_helm
from tests.operator.test_operator import NS, SPEC, created_and_ready, eventually, writes
from ucm_testing.kmock_operator import Driver, Emulator, declare, operator_running

pytestmark = pytest.mark.kmock(cls=Emulator)

CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/ucmdeployments.ucm.io"
RELEASE, RELEASE_NS = "ucm", "ucm-system"
ADDED_FIELD = "whenDeleted"  # a field of the CRD the previous layout's schema did not have
# What the Kubernetes guide tells a cluster installed from the previous layout to run once:
#   kubectl label crd ucmdeployments.ucm.io app.kubernetes.io/managed-by=Helm
#   kubectl annotate crd ucmdeployments.ucm.io meta.helm.sh/release-name=<release> \
#     meta.helm.sh/release-namespace=<namespace>
ADOPT = {
    "metadata": {
        "labels": {"app.kubernetes.io/managed-by": "Helm"},
        "annotations": {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": RELEASE_NS},
    }
}


def previous_chart(tmp: Path) -> Path:
    """This chart as its previous layout shipped it: the CRD under crds/, without a field added since."""
    old = tmp / "previous" / "ucm-operator"
    shutil.copytree(CHART, old)
    (old / "templates" / "crd.yaml").unlink()
    crd = yaml.safe_load((old / "files" / "ucm.io_ucmdeployments.yaml").read_text())
    assert _drop(crd, ADDED_FIELD), f"the CRD has no {ADDED_FIELD} any more: pick another added field"
    (old / "crds").mkdir()
    (old / "crds" / "ucm.io_ucmdeployments.yaml").write_text(yaml.safe_dump(crd))
    return old


def _drop(node: Any, key: str) -> bool:
    if isinstance(node, dict):
        dropped = node.pop(key, None) is not None
        return any([dropped, *(_drop(v, key) for v in node.values())])
    if isinstance(node, list):
        return any([_drop(v, key) for v in node])
    return False


def _holds(node: Any, key: str) -> bool:
    if isinstance(node, dict):
        return key in node or any(_holds(v, key) for v in node.values())
    return isinstance(node, list) and any(_holds(v, key) for v in node)


class Helm:
    def __init__(self, url: str, tmp: Path) -> None:
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "kmock", "cluster": {"server": url}}],
                    "users": [{"name": "admin", "user": {"token": "t"}}],
                    "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "admin"}}],
                    "current-context": "kmock",
                }
            )
        )
        self.tmp = tmp

    async def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [*args, "-n", RELEASE_NS, "--kubeconfig", str(self.kubeconfig)]
        if args[0] in ("install", "upgrade"):
            argv += ["--server-side=false", "--disable-openapi-validation"]  # what kmock lacks
        # In a thread: kmock serves helm from this event loop.
        return await asyncio.to_thread(run_helm, *argv, tmp=self.tmp)


@pytest_asyncio.fixture
async def cluster(kmock) -> AsyncIterator[Driver]:
    declare(kmock)
    for plural, kind in (("clusterroles", "ClusterRole"), ("clusterrolebindings", "ClusterRoleBinding")):
        kmock.resources[f"rbac.authorization.k8s.io/v1/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=False, verbs={"get", "list", "watch", "create", "update", "patch", "delete"}
        )
    driver = Driver(str(kmock.url))
    try:
        yield driver
    finally:
        await driver.close()


@pytest.mark.asyncio
async def test_a_release_of_the_previous_layout_upgrades_its_crd_and_keeps_its_resources(kmock, cluster, tmp_path):
    helm = Helm(cluster.url, tmp_path)
    installed = await helm("install", RELEASE, str(previous_chart(tmp_path)))
    assert installed.returncode == 0, installed.stderr
    crd = await cluster.call("GET", CRD)
    assert not _holds(crd["spec"], ADDED_FIELD)
    assert "meta.helm.sh/release-name" not in (crd["metadata"].get("annotations") or {})  # crds/: not the release's

    async with operator_running(cluster.url):
        await created_and_ready(cluster, "a")  # written for the previous release

    # Helm takes over no object its release did not create: the upgrade stops, saying why.
    refused = await helm("upgrade", RELEASE, str(CHART))
    assert refused.returncode != 0
    assert "invalid ownership metadata" in refused.stderr, refused.stderr

    await cluster.call("PATCH", CRD, ADOPT)  # the one command of the upgrade guide
    upgraded = await helm("upgrade", RELEASE, str(CHART))
    assert upgraded.returncode == 0, upgraded.stderr
    crd = await cluster.call("GET", CRD)
    assert _holds(crd["spec"], ADDED_FIELD), "helm upgrade left the previous schema"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    # The upgraded operator resumes the resource without a write, then follows its spec.
    since = len(kmock.calls)
    async with operator_running(cluster.url):
        await asyncio.sleep(2)
        assert [w for w in writes(kmock, since) if not w[1].startswith("events")] == []
        await cluster.update_ucmd(NS, "a", {**SPEC, "decode": {**SPEC["decode"], "replicas": 3}}, generation=2)

        async def scaled() -> None:
            decode = await cluster.call("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/a-decode")
            assert decode["spec"]["replicas"] == 3

        await eventually(scaled)

    again = await helm("upgrade", RELEASE, str(CHART))  # an upgrade to the same chart changes nothing
    assert again.returncode == 0, again.stderr
    uninstalled = await helm("uninstall", RELEASE)
    assert uninstalled.returncode == 0, uninstalled.stderr
    assert (await cluster.call("GET", CRD))["metadata"]["name"] == "ucmdeployments.ucm.io"  # kept
    assert (await cluster.ucmd(NS, "a"))["spec"]["decode"]["replicas"] == 3
