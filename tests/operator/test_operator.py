"""The real operator (Kopf + ucm_operator) against kmock: children, status, no-op, updates, deletion."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import yaml

from ucm.deploy.autoscaling import Autoscaler
from ucm.deploy.monitors import Monitors
from ucm.deploy.policy import Policy
from ucm.deploy.ports import free_port
from ucm_operator.api import path as child_path
from ucm_proxy.config import DiscoveryConfig
from ucm_proxy.discovery import write_pd_path
from ucm_proxy.pdpath import PathCheck, RecentPaths
from ucm_testing.kmock_operator import WRITE_VERBS, Driver, Emulator, allowed, operator_running, posted_events

pytestmark = pytest.mark.kmock(cls=Emulator)
NS = "serving"
SPEC: dict[str, Any] = {
    "model": {"source": {"pvc": {"claimName": "models", "path": "/llama"}}, "servedName": "llama"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 2},
    "store": {"type": "posix", "pvc": {"create": {"size": "1Ti", "storageClassName": "cephfs"}}},
    "proxy": {"replicas": 1},
}
CHILDREN = {
    ("ConfigMap", "a-config"),
    ("PersistentVolumeClaim", "a-kv"),
    ("Deployment", "a-prefill"),
    ("Deployment", "a-decode"),
    ("Deployment", "a-proxy"),
    ("Service", "a-prefill"),
    ("Service", "a-decode"),
    ("Service", "a-proxy"),
    ("PodDisruptionBudget", "a-prefill"),
    ("PodDisruptionBudget", "a-decode"),
    ("ServiceAccount", "a-proxy"),
    ("Role", "a-proxy"),
    ("RoleBinding", "a-proxy"),
    ("Secret", "a-credentials"),
    ("NetworkPolicy", "a-engines"),
}


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 15.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await check()
        except (AssertionError, KeyError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def refuse_creates(kmock, plural: str, status: int, message: str, until: Callable[[], bool] = lambda: False) -> None:
    """The API server answers ``status`` to every create of ``plural`` (until ``until()`` holds)."""
    reaction = (
        kmock["post"][lambda req: req.url.path.endswith(f"/{plural}") and not until()]
        << status
        << {"kind": "Status", "status": "Failure", "message": message}
    )
    assert reaction is not None


async def degraded(cluster: Driver, name: str, reason: str) -> dict[str, Any]:
    """The Degraded condition, once it is True with ``reason``."""

    async def check() -> dict[str, Any]:
        cond = conditions(await cluster.ucmd(NS, name))["Degraded"]
        assert cond["status"] == "True" and cond["reason"] == reason, cond
        return cond

    return await eventually(check)


def writes(k, since: int = 0) -> list[tuple[str, str, str, str]]:
    return [c[:4] for c in k.calls[since:] if c.verb in WRITE_VERBS]


def child_writes_since(k, since: int) -> set[tuple[str, str]]:
    """(resource, name) of every write to a child after request number ``since``."""
    return {
        (c[1], c[3].rsplit("/", 1)[-1]) for c in writes(k, since) if not c[1].startswith(("ucmdeployments", "events"))
    }


async def created_and_ready(cluster: Driver, name: str = "a", spec: dict[str, Any] = SPEC) -> None:
    await cluster.apply_ucmd(NS, name, spec, uid=f"uid-{name}")

    async def all_children() -> None:
        assert set(await cluster.children(NS, name)) == {(k, n.replace("a-", f"{name}-", 1)) for k, n in CHILDREN}

    await eventually(all_children)
    await cluster.play_deployment_controller(NS, name)

    async def ready() -> None:
        assert conditions(await cluster.ucmd(NS, name))["Ready"]["status"] == "True"

    await eventually(ready)


@pytest.mark.asyncio
async def test_create_gives_owned_children_and_status_follows_readiness(kmock, cluster):
    async with operator_running(cluster.url):
        await cluster.apply_ucmd(NS, "a", SPEC, uid="uid-a")

        async def progressing() -> dict[str, Any]:
            kids = await cluster.children(NS, "a")
            assert set(kids) == CHILDREN
            obj = await cluster.ucmd(NS, "a")
            cond = conditions(obj)
            assert cond["Ready"]["status"] == "False" and cond["Progressing"]["status"] == "True"
            return kids

        kids = await eventually(progressing)
        for obj in kids.values():
            (ref,) = obj["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("UCMDeployment", "a", "uid-a", True)
            assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "ucm-operator"
        decode = kids[("Deployment", "a-decode")]["spec"]
        assert decode["replicas"] == 2
        container = decode["template"]["spec"]["containers"][0]
        assert container["command"][:3] == ["ucm", "serve", "--kv-config"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
        assert kids[("Service", "a-decode")]["spec"]["clusterIP"] == "None"

        # Only the controller's ready replicas make it Ready, role by role.
        await cluster.play_deployment_controller(NS, "a")

        async def ready() -> dict[str, Any]:
            obj = await cluster.ucmd(NS, "a")
            cond = conditions(obj)
            assert [
                cond[t]["status"] for t in ("Ready", "StoreReady", "PrefillReady", "DecodeReady", "ProxyReady")
            ] == ["True"] * 5
            assert cond["Progressing"]["status"] == "False" and cond["Degraded"]["status"] == "False"
            return obj

        obj = await eventually(ready)
        status = obj["status"]
        assert status["readyReplicas"] == {"prefill": 1, "decode": 2, "proxy": 1}
        assert status["endpoint"] == "http://a-proxy.serving.svc:8000/v1"
        assert status["observedGeneration"] == 1
        # What `kubectl scale` and an HPA read through the scale subresource: the decode pods.
        assert status["decodeSelector"] == "app.kubernetes.io/instance=a,app.kubernetes.io/component=decode"
        assert all(c["observedGeneration"] == 1 and c["lastTransitionTime"] for c in status["conditions"])

        async def ready_event() -> None:
            assert any("Ready=True" in e.get("message", "") for e in posted_events(kmock.calls))

        await eventually(ready_event)

        # A pool losing its pods turns Ready off again.
        await cluster.play_deployment_controller(NS, "a", ready=False)

        async def not_ready() -> None:
            cond = conditions(await cluster.ucmd(NS, "a"))
            assert cond["Ready"]["status"] == "False" and cond["DecodeReady"]["message"] == "0/2 ready"

        await eventually(not_ready)


@pytest.mark.asyncio
async def test_changes_patch_only_what_changed(kmock, cluster):
    async with operator_running(cluster.url):
        await created_and_ready(cluster)
        before = await cluster.children(NS, "a")
        mark = len(kmock.calls)
        spec = copy.deepcopy(SPEC)
        spec["decode"]["replicas"] = 3
        await cluster.update_ucmd(NS, "a", spec, generation=2)

        async def scaled() -> None:
            kids = await cluster.children(NS, "a")
            assert kids[("Deployment", "a-decode")]["spec"]["replicas"] == 3

        await eventually(scaled)
        await asyncio.sleep(0.5)  # anything else would have been written by now
        assert child_writes_since(kmock, mark) == {("deployments", "a-decode")}

        # A store option changes the connector config: the ConfigMap, and the engines roll (their
        # config hash changed) while the proxy, Services and the rest stay untouched.
        mark = len(kmock.calls)
        spec["store"]["cacheSize"] = "8Gi"
        await cluster.update_ucmd(NS, "a", spec, generation=3)

        async def reconfigured() -> None:
            kids = await cluster.children(NS, "a")
            assert '"cache|posix"' in kids[("ConfigMap", "a-config")]["data"]["kv-transfer-config.json"]

        await eventually(reconfigured)
        await asyncio.sleep(0.5)
        assert child_writes_since(kmock, mark) == {
            ("configmaps", "a-config"),
            ("deployments", "a-prefill"),
            ("deployments", "a-decode"),
        }
        after = await cluster.children(NS, "a")
        hashes = lambda kids, k: kids[k]["spec"]["template"]["metadata"]["annotations"]["ucm.io/config-hash"]  # noqa: E731
        assert hashes(before, ("Deployment", "a-decode")) != hashes(after, ("Deployment", "a-decode"))
        assert hashes(before, ("Deployment", "a-proxy")) == hashes(after, ("Deployment", "a-proxy"))


@pytest.mark.asyncio
async def test_turning_the_store_mac_on_adds_a_key_and_changes_none(kmock, cluster):
    """store.mac: the credentials Secret gains the MAC key (the engines' key stays: the proxy holds
    it), engines mount only that key and their connector signs with it; the proxy sees neither."""
    async with operator_running(cluster.url):
        await created_and_ready(cluster)
        secret = ("Secret", "a-credentials")
        before = (await cluster.children(NS, "a"))[secret]["data"]
        spec = copy.deepcopy(SPEC)
        spec["store"]["mac"] = True
        await cluster.update_ucmd(NS, "a", spec, generation=2)

        async def signed() -> dict[tuple[str, str], dict[str, Any]]:
            kids = await cluster.children(NS, "a")
            assert "kv-mac-key" in kids[secret]["data"]
            assert (
                '"mac_key_file": "/etc/ucm-credentials/kv-mac-key"'
                in kids[("ConfigMap", "a-config")]["data"]["kv-transfer-config.json"]
            )
            return kids

        kids = await eventually(signed)
        data = kids[secret]["data"]
        assert data["backend-api-key"] == before["backend-api-key"]
        assert len(base64.b64decode(data["kv-mac-key"])) >= 32

        def secret_volume(deployment: str) -> list[Any]:
            pod = kids[("Deployment", deployment)]["spec"]["template"]["spec"]
            return [v["secret"] for v in pod["volumes"] if "secret" in v]

        for engine in ("a-prefill", "a-decode"):
            assert secret_volume(engine) == [
                {"secretName": "a-credentials", "items": [{"key": "kv-mac-key", "path": "kv-mac-key"}]}
            ]
        assert secret_volume("a-proxy") == [
            {"secretName": "a-credentials", "items": [{"key": "backend-api-key", "path": "backend-api-key"}]}
        ]
        mark = len(kmock.calls)
        await cluster.update_ucmd(NS, "a", {**spec, "decode": {"replicas": 3}}, generation=3)
        await eventually(lambda: _replicas(cluster, "a-decode", 3))
        await asyncio.sleep(0.5)
        assert ("secrets", "a-credentials") not in child_writes_since(kmock, mark)  # added once, then left


async def _replicas(cluster: Driver, deployment: str, n: int) -> None:
    kids = await cluster.children(NS, deployment.split("-")[0])
    assert kids[("Deployment", deployment)]["spec"]["replicas"] == n


@pytest.mark.asyncio
async def test_restart_on_unchanged_state_writes_nothing(kmock, cluster):
    async with operator_running(cluster.url):
        await created_and_ready(cluster)
        await asyncio.sleep(0.5)
        before = await cluster.children(NS, "a")
    mark = len(kmock.calls)
    async with operator_running(cluster.url):
        await asyncio.sleep(2.0)  # resume handlers and the initial watch events have run
        after = await cluster.children(NS, "a")
    # Kopf's own bookkeeping on the object (PATCH of the resource itself) is not ours to judge;
    # children, status and Events must see no write at all.
    ours = [c for c in writes(kmock, mark) if not (c[1] == "ucmdeployments" and c[2] == "patch")]
    assert ours == []
    assert before == after


@pytest.mark.asyncio
async def test_delete_removes_children_then_the_object(kmock, cluster):
    async with operator_running(cluster.url):
        await created_and_ready(cluster)
        await cluster.call("DELETE", f"/apis/ucm.io/v1alpha1/namespaces/{NS}/ucmdeployments/a")

        async def gone() -> None:
            listing = await cluster.call("GET", f"/apis/ucm.io/v1alpha1/namespaces/{NS}/ucmdeployments")
            assert listing["items"] == []
            # The credentials Secret goes with its owner reference (Kubernetes' garbage collector,
            # which kmock does not run): the operator holds no delete right on Secrets.
            assert set(await cluster.children(NS, "a")) <= {("Secret", "a-credentials")}

        await eventually(gone)
        deletes = [c.path.rsplit("/", 1)[-1] for c in kmock.calls if c.verb == "delete"]
        assert deletes.index("a-proxy") < deletes.index("a-prefill") < deletes.index("a-kv")


@pytest.mark.asyncio
async def test_a_kept_claim_outlives_its_deployment_and_serves_the_next_of_its_name(kmock, cluster):
    """store.pvc.create.whenDeleted: Retain: the claim carries no owner reference (no cascade deletes
    it), deletion leaves it with an Event, and a UCMDeployment of the same name takes it again."""
    kept = copy.deepcopy(SPEC)
    kept["store"]["pvc"]["create"]["whenDeleted"] = "Retain"
    ucmd = f"/apis/ucm.io/v1alpha1/namespaces/{NS}/ucmdeployments"
    async with operator_running(cluster.url):
        await created_and_ready(cluster, "a", kept)
        claim = await cluster.call("GET", child_path("PersistentVolumeClaim", NS, "a-kv"))
        assert "ownerReferences" not in claim["metadata"]
        await cluster.call("DELETE", f"{ucmd}/a")

        async def gone_but_the_claim() -> None:
            assert (await cluster.call("GET", ucmd))["items"] == []
            assert set(await cluster.children(NS, "a")) <= {
                ("Secret", "a-credentials"),
                ("PersistentVolumeClaim", "a-kv"),
            }
            retained = [e["message"] for e in posted_events(kmock.calls) if e.get("reason") == "Retained"]
            assert retained and retained[0].startswith("PersistentVolumeClaim a-kv kept"), retained

        await eventually(gone_but_the_claim)
        assert not [c for c in kmock.calls if c.verb == "delete" and c.path.endswith("/a-kv")]
        assert (await cluster.call("GET", child_path("PersistentVolumeClaim", NS, "a-kv")))["metadata"]["uid"] == (
            claim["metadata"]["uid"]
        )

        await cluster.call("DELETE", child_path("Secret", NS, "a-credentials"))  # the garbage collector's part
        # The next deployment named a, now deleting its claim with it: the same claim, adopted.
        await cluster.apply_ucmd(NS, "a", SPEC, uid="uid-a2")

        async def adopted() -> None:
            now = await cluster.call("GET", child_path("PersistentVolumeClaim", NS, "a-kv"))
            assert now["metadata"]["uid"] == claim["metadata"]["uid"]
            assert [r["uid"] for r in now["metadata"].get("ownerReferences") or []] == ["uid-a2"]

        await eventually(adopted)
        assert conditions(await cluster.ucmd(NS, "a"))["Degraded"]["status"] == "False"

        # And back to Retain: the owner reference goes again.
        await cluster.update_ucmd(NS, "a", kept, generation=2)

        async def released() -> None:
            now = await cluster.call("GET", child_path("PersistentVolumeClaim", NS, "a-kv"))
            assert not now["metadata"].get("ownerReferences"), now["metadata"]

        await eventually(released)


@pytest.mark.asyncio
async def test_a_claim_the_user_brought_is_never_deleted(kmock, cluster):
    theirs = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "team-kv", "namespace": NS}}
    theirs["spec"] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Ti"}}}
    await cluster.call("POST", child_path("PersistentVolumeClaim", NS), theirs)
    spec = {**SPEC, "store": {"type": "posix", "pvc": {"claimName": "team-kv"}}}
    async with operator_running(cluster.url):
        await cluster.apply_ucmd(NS, "u", spec, uid="uid-u")

        async def running() -> None:
            assert ("Deployment", "u-decode") in await cluster.children(NS, "u")

        await eventually(running)
        await cluster.call("DELETE", f"/apis/ucm.io/v1alpha1/namespaces/{NS}/ucmdeployments/u")

        async def gone() -> None:
            assert set(await cluster.children(NS, "u")) <= {("Secret", "u-credentials")}

        await eventually(gone)
        assert await cluster.call("GET", child_path("PersistentVolumeClaim", NS, "team-kv"))
        assert not [c for c in kmock.calls if c.verb == "delete" and c.path.endswith("/team-kv")]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"store": {"type": "mooncake", "mooncake": {}}}, "spec.store.mooncake: set exactly one of master"),
        ({"store": {"type": "mooncake", "mooncake": {"address": "m:1"}}}, "spec.store.mooncake.metadataServer"),
        ({"store": {"type": "posix", "pvc": {"claimName": "kv"}, "cacheSize": "lots"}}, "spec.store.cacheSize"),
        ({"proxy": {"config": {"routing": {"prefill": "bogus"}}}}, "spec.proxy.config.routing.prefill"),
        ({"proxy": {"config": {"port": 1}}}, "spec.proxy.config.port: set by the deployment"),
    ],
)
async def test_invalid_spec_is_degraded_and_touches_nothing(kmock, cluster, change, field):
    async with operator_running(cluster.url):
        mark = len(kmock.calls)
        await cluster.apply_ucmd(NS, "bad", {**SPEC, **change}, uid="uid-bad")

        cond = await degraded(cluster, "bad", "InvalidSpec")
        assert cond["message"].startswith(field), cond["message"]
        assert conditions(await cluster.ucmd(NS, "bad"))["Ready"]["status"] == "False"
        await asyncio.sleep(0.5)
        assert [c for c in writes(kmock, mark) if not c[1].startswith(("ucmdeployments", "events"))] == []
        assert await cluster.children(NS, "bad") == {}


@pytest.mark.asyncio
async def test_ucm_render_prints_what_the_operator_creates(kmock, cluster, tmp_path):
    spec = {**SPEC, "store": {"type": "mooncake", "mooncake": {"master": {}}}, "proxy": {"config": {"retries": 2}}}
    resource = {"apiVersion": "ucm.io/v1alpha1", "kind": "UCMDeployment", "metadata": {"name": "r"}, "spec": spec}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(resource))
    exe = Path(sys.executable).parent / "ucm"
    cmd = [str(exe), "render", "-f", str(tmp_path / "r.yaml"), "-n", NS, "--owner-uid", "uid-r"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out)}
    async with operator_running(cluster.url):
        await cluster.apply_ucmd(NS, "r", spec, uid="uid-r")

        async def created() -> dict[tuple[str, str], dict[str, Any]]:
            kids = await cluster.children(NS, "r")
            assert set(kids) == set(rendered)
            return kids

        live = await eventually(created)
    assert ("Deployment", "r-mooncake-master") in live
    # The credentials are rendered without a value: the operator draws it when it creates the Secret.
    generated = live[("Secret", "r-credentials")].pop("data")
    assert list(generated) == ["backend-api-key"] and len(base64.b64decode(generated["backend-api-key"])) >= 32
    for key, obj in live.items():
        meta = {k: v for k, v in obj["metadata"].items() if k not in ("uid", "resourceVersion", "generation")}
        assert {**obj, "metadata": meta} == rendered[key], key


@pytest.mark.asyncio
async def test_the_console_script_runs_the_operator_with_a_liveness_endpoint(kmock, cluster, tmp_path):
    port = free_port()
    log = open(tmp_path / "operator.log", "wb")  # noqa: SIM115 - closed below
    exe = Path(sys.executable).parent / "ucm-operator"
    liveness = f"http://127.0.0.1:{port}/healthz"
    proc = subprocess.Popen([str(exe), "--server", cluster.url, "--liveness", liveness], stdout=log, stderr=log)
    try:

        async def alive() -> None:
            assert proc.poll() is None, (tmp_path / "operator.log").read_text()
            async with aiohttp.ClientSession() as http:
                try:
                    async with http.get(liveness) as r:
                        assert r.status == 200
                except aiohttp.ClientConnectionError as exc:
                    raise AssertionError(str(exc)) from None

        await eventually(alive, timeout=30)
        await created_and_ready(cluster, "cli")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        log.close()


@pytest.mark.asyncio
async def test_a_permanent_refusal_is_degraded_and_not_retried_forever(kmock, cluster, monkeypatch):
    """422 (say, an env name the API server rejects) is reported, not retried every 15 s."""
    monkeypatch.setattr("ucm_operator.handlers.RETRY_DELAY_S", 0.2)
    refuse_creates(kmock, "deployments", 422, "spec.template.spec.containers[0].env[0].name: Invalid value")
    async with operator_running(cluster.url):
        await cluster.apply_ucmd(NS, "r", SPEC, uid="uid-r")

        cond = await degraded(cluster, "r", "ApplyFailed")
        assert "422" in cond["message"] and "env[0].name" in cond["message"]
        before = await settled_posts(kmock)  # Kopf's causes (create/resume/update) may come late on a busy machine
        await asyncio.sleep(1.5)  # a temporary error would have been retried ~7 more times by now
        assert deployment_posts(kmock) == before <= 3  # once per Kopf cause (create/resume/update), then no more


def deployment_posts(kmock) -> int:
    return sum(1 for c in kmock.calls if c.verb == "create" and c.resource == "deployments")


async def settled_posts(kmock, window_s: float = 0.5, limit_s: float = 10.0) -> int:
    """Deployment POSTs once no new one came for ``window_s`` (or after ``limit_s``: a retry loop never
    settles, and the caller's check then sees the count still growing)."""
    count, deadline = deployment_posts(kmock), asyncio.get_running_loop().time() + limit_s
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(window_s)
        now = deployment_posts(kmock)
        if now == count:
            break
        count = now
    return count


@pytest.mark.asyncio
async def test_a_name_taken_by_another_object_is_a_conflict_not_an_adoption(kmock, cluster):
    """Patching it would stamp our owner reference on it: deleting the deployment would delete it."""
    victim = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "c-proxy", "namespace": NS, "labels": {"team": "other"}},
        "spec": {"ports": [{"port": 1}]},
    }
    await cluster.call("POST", child_path("Service", NS), victim)
    async with operator_running(cluster.url):
        await cluster.apply_ucmd(NS, "c", SPEC, uid="uid-c")

        cond = await degraded(cluster, "c", "NameConflict")
        assert "Service serving/c-proxy already exists and is not controlled by this UCMDeployment" in cond["message"]
        got = await cluster.call("GET", child_path("Service", NS, "c-proxy"))
        assert "ownerReferences" not in got["metadata"] and got["spec"]["ports"] == [{"port": 1}]
        assert not [c for c in kmock.calls if c.verb == "patch" and c.path.endswith("/services/c-proxy")]


@pytest.mark.asyncio
async def test_an_old_spelling_is_served_and_reported(kmock, cluster):
    """A resource written before spec.sparse took camelCase keeps working (the decode engines get its
    options) and gets a Warning Event naming the field and its new spelling."""
    spec = copy.deepcopy(SPEC)
    spec["sparse"] = {"algorithm": "esa", "min_tokens": 64, "esa": {"sparseRatio": 0.5}}
    spec["decode"]["resources"] = {"gpus": 0}  # sparse attention runs on CPU engines
    async with operator_running(cluster.url):
        await cluster.apply_ucmd(NS, "a", spec, uid="uid-a")

        async def sparse_decoders() -> None:
            config = (await cluster.children(NS, "a"))[("ConfigMap", "a-config")]["data"]
            decode = json.loads(config["kv-transfer-config-decode.json"])["kv_connector_extra_config"]
            assert decode["sparse"] == {"algorithm": "esa", "min_tokens": 64, "esa": {"sparse_ratio": 0.5}}

        await eventually(sparse_decoders)

        async def warned() -> None:
            events = [e for e in posted_events(kmock.calls) if e.get("reason") == "DeprecatedField"]
            assert len(events) == 1
            event = events[0]
            assert event["type"] == "Warning"
            assert event["message"] == "spec.sparse.min_tokens is deprecated: write spec.sparse.minTokens"

        await eventually(warned)


@pytest.mark.parametrize("provider", ["keda", "hpa"])
@pytest.mark.asyncio
async def test_an_autoscaled_pool_is_left_to_its_autoscaler(kmock, cluster, provider):
    """The autoscaler owns the decode count: the operator renders it (a KEDA ScaledObject or an HPA,
    as configured), never writes the Deployment's replicas (on a spec change either), and calls the
    pool ready at the autoscaler's count."""
    spec = copy.deepcopy(SPEC)
    spec["decode"]["autoscaling"] = {"maxReplicas": 4, "signal": "kv_cache_usage"}
    kind = {"keda": "ScaledObject", "hpa": "HorizontalPodAutoscaler"}[provider]
    async with operator_running(cluster.url, Policy(autoscaler=Autoscaler(provider=provider))):
        await cluster.apply_ucmd(NS, "a", spec, uid="uid-a")

        async def created() -> dict[tuple[str, str], dict[str, Any]]:
            kids = await cluster.children(NS, "a")
            assert set(kids) == CHILDREN | {(kind, "a-decode")}
            return kids

        kids = await eventually(created)
        assert "replicas" not in kids[("Deployment", "a-decode")]["spec"]
        scaler = kids[(kind, "a-decode")]["spec"]
        assert scaler["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "a-decode"}
        if provider == "keda":
            assert (scaler["minReplicaCount"], scaler["maxReplicaCount"]) == (1, 4)
            trigger = scaler["triggers"][0]["metadata"]
            assert (
                trigger["query"]
                == 'sum(vllm:kv_cache_usage_perc{namespace="serving",pod=~"a-decode-[a-z0-9]+(-[a-z0-9]+)?"})'
            )
            assert trigger["threshold"] == "0.8"
        else:
            assert (scaler["minReplicas"], scaler["maxReplicas"]) == (1, 4)
            assert scaler["metrics"][0]["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}

        # The autoscaler scales decode to 3; the pods come up.
        await cluster.call("PATCH", child_path("Deployment", NS, "a-decode"), {"spec": {"replicas": 3}})
        await cluster.play_deployment_controller(NS, "a")

        async def ready_at_three() -> None:
            cond = conditions(await cluster.ucmd(NS, "a"))
            assert cond["DecodeReady"]["status"] == "True" and cond["DecodeReady"]["message"] == "3/3 ready"

        await eventually(ready_at_three)
        since = len(kmock.calls)
        spec["decode"]["env"] = [{"name": "NCCL_DEBUG", "value": "WARN"}]
        await cluster.update_ucmd(NS, "a", spec, generation=2)

        async def rolled() -> dict[str, Any]:
            deployment = (await cluster.children(NS, "a"))[("Deployment", "a-decode")]
            env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            assert {"name": "NCCL_DEBUG", "value": "WARN"} in env
            return deployment

        deployment = await eventually(rolled)
        assert deployment["spec"]["replicas"] == 3
        patches = [c for c in kmock.calls[since:] if c.verb == "patch" and c.path.endswith("/deployments/a-decode")]
        assert patches and not [c for c in patches if "replicas" in (c.data or {}).get("spec", {})]

        # `kubectl scale ucmd a --replicas 5` changes spec.decode.replicas: nothing moves, and the user is told.
        spec["decode"]["replicas"] = 5
        await cluster.update_ucmd(NS, "a", spec, generation=3)

        async def told() -> None:
            events = [e for e in posted_events(kmock.calls) if e.get("reason") == "ReplicasIgnored"]
            assert len(events) == 1
            event = events[0]
            assert event["type"] == "Warning" and event["message"].startswith(
                "spec.decode.replicas changed to 5, which does nothing: spec.decode.autoscaling sizes the pool (1 to 4)"
            )

        await eventually(told)
        assert (await cluster.children(NS, "a"))[("Deployment", "a-decode")]["spec"]["replicas"] == 3


@pytest.mark.asyncio
async def test_scale_to_zero_with_hpas_is_refused_naming_the_field(kmock, cluster):
    spec = copy.deepcopy(SPEC)
    spec["decode"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 4}
    async with operator_running(cluster.url, Policy(autoscaler=Autoscaler(provider="hpa"))):
        await cluster.apply_ucmd(NS, "a", spec, uid="uid-a")

        async def refused() -> None:
            degraded = conditions(await cluster.ucmd(NS, "a"))["Degraded"]
            assert degraded["reason"] == "PolicyRefused"
            assert degraded["message"].startswith("spec.decode.autoscaling.minReplicas: 0 (scale to zero) needs")

        await eventually(refused)
        assert not await cluster.children(NS, "a")


@pytest.mark.asyncio
async def test_the_proxys_pd_path_check_becomes_conditions(kmock, cluster, tmp_path):
    """The proxy writes status.pdPath with its Role's one status right; the operator turns it into
    PDPathHealthy and DisaggregationEffective and keeps it through its own status writes."""
    async with operator_running(cluster.url):
        await created_and_ready(cluster)
        cond = conditions(await cluster.ucmd(NS, "a"))
        assert (cond["PDPathHealthy"]["status"], cond["PDPathHealthy"]["reason"]) == ("Unknown", "NotChecked")

        role = (await cluster.children(NS, "a"))[("Role", "a-proxy")]
        assert allowed(role["rules"], "ucm.io", "ucmdeployments/status", "patch")
        (status_rule,) = [r for r in role["rules"] if "ucmdeployments/status" in r["resources"]]
        assert status_rule["resourceNames"] == ["a"]  # its own resource only

        config = DiscoveryConfig(
            namespace=NS, decode_service="a-decode", api_server=cluster.url, token_path=tmp_path / "t", ca_path=None
        )
        recent = RecentPaths()
        write = write_pd_path(SimpleNamespace(recent=recent), config.model_copy(update={"resource": "a"}))
        await write(PathCheck(False, "DecodeNotLoading", "decode d computed the whole prompt", 1.8e9, "p", "d"))

        async def broken() -> None:
            cond = conditions(await cluster.ucmd(NS, "a"))
            assert cond["PDPathHealthy"]["status"] == "False"
            assert cond["PDPathHealthy"]["reason"] == "DecodeNotLoading"
            assert cond["PDPathHealthy"]["message"].startswith("decode d computed the whole prompt (checked 2027-")
            assert cond["DisaggregationEffective"]["status"] == "Unknown"

        await eventually(broken)
        for _ in range(3):
            recent.record("pd")
        await write(PathCheck(True, "Healthy", "p → store → d: 3 blocks", 1.8e9 + 30, "p", "d"))

        async def healthy() -> None:
            obj = await cluster.ucmd(NS, "a")
            cond = conditions(obj)
            assert (cond["PDPathHealthy"]["status"], cond["DisaggregationEffective"]["status"]) == ("True", "True")
            assert cond["DisaggregationEffective"]["reason"] == "Disaggregated"
            assert cond["Ready"]["status"] == "True"
            assert obj["status"]["pdPath"]["reason"] == "Healthy"

        await eventually(healthy)
        # The operator's own status writes leave the proxy's field as it is.
        await cluster.play_deployment_controller(NS, "a", ready=False)

        async def kept() -> None:
            obj = await cluster.ucmd(NS, "a")
            assert conditions(obj)["Ready"]["status"] == "False"
            assert obj["status"]["pdPath"]["healthy"] is True

        await eventually(kept)


@pytest.mark.asyncio
async def test_with_the_prometheus_operator_each_deployment_gets_its_monitors(kmock, cluster):
    monitors = Monitors(enabled=True, labels=(("release", "prom"),))
    async with operator_running(cluster.url, Policy(monitors=monitors)):
        await cluster.apply_ucmd(NS, "a", SPEC, uid="uid-a")
        want = CHILDREN | {("PodMonitor", "a-engines"), ("ServiceMonitor", "a-proxy")}

        async def all_children() -> dict:
            kids = await cluster.children(NS, "a")
            assert set(kids) == want
            return kids

        kids = await eventually(all_children)
    for kind in ("PodMonitor", "ServiceMonitor"):
        (obj,) = [o for (k, _), o in kids.items() if k == kind]
        assert obj["metadata"]["labels"]["release"] == "prom"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-a"  # deleted with the deployment


MULTI_NODE = {
    **SPEC,
    "prefill": {"replicas": 1, "parallel": {"tensor": 4, "nodes": 2}, "resources": {"gpus": 2}},
    "decode": {"replicas": 2, "parallel": {"tensor": 4, "nodes": 2}, "resources": {"gpus": 2}},
}


@pytest.mark.asyncio
async def test_multi_node_engines_are_leader_worker_sets_that_roll_and_report_as_groups(kmock, cluster):
    async with operator_running(cluster.url):
        await cluster.apply_ucmd(NS, "m", MULTI_NODE, uid="uid-m")
        want = {(k, n.replace("a-", "m-", 1)) for k, n in CHILDREN} - {
            ("Deployment", "m-prefill"),
            ("Deployment", "m-decode"),
        }
        want |= {("LeaderWorkerSet", "m-prefill-group"), ("LeaderWorkerSet", "m-decode-group")}

        async def created() -> dict:
            kids = await cluster.children(NS, "m")
            assert set(kids) == want
            return kids

        kids = await eventually(created)
        group = kids[("LeaderWorkerSet", "m-decode-group")]
        assert group["spec"]["replicas"] == 2 and group["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert kids[("Service", "m-decode")]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"

        # Ready follows the groups the controller reports ready.
        await cluster.play_deployment_controller(NS, "m")

        async def ready() -> dict[str, Any]:
            obj = await cluster.ucmd(NS, "m")
            cond = conditions(obj)
            assert cond["Ready"]["status"] == "True" and cond["DecodeReady"]["message"] == "2/2 ready", cond
            return obj

        obj = await eventually(ready)
        # What an HPA on the resource's scale subresource averages over: the leaders, which serve.
        assert obj["status"]["decodeSelector"] == (
            "app.kubernetes.io/instance=m,app.kubernetes.io/component=decode,leaderworkerset.sigs.k8s.io/worker-index=0"
        )
        await cluster.play_deployment_controller(NS, "m", ready=False)

        async def not_ready() -> None:
            cond = conditions(await cluster.ucmd(NS, "m"))
            assert cond["Ready"]["status"] == "False" and cond["PrefillReady"]["message"] == "0/1 ready", cond

        await eventually(not_ready)

        # A new runtime image rolls the groups (one patch each) and nothing else (the proxy has its own
        # image); a restart on the same spec writes nothing.
        mark = len(kmock.calls)
        spec = {**MULTI_NODE, "image": {"tag": "next"}}
        await cluster.update_ucmd(NS, "m", spec, generation=2)

        async def rolled() -> None:
            kids = await cluster.children(NS, "m")
            template = kids[("LeaderWorkerSet", "m-decode-group")]["spec"]["leaderWorkerTemplate"]["workerTemplate"]
            assert template["spec"]["containers"][0]["image"].endswith(":next")

        await eventually(rolled)
        await asyncio.sleep(0.5)
        assert child_writes_since(kmock, mark) == {
            ("leaderworkersets", "m-prefill-group"),
            ("leaderworkersets", "m-decode-group"),
        }

    mark = len(kmock.calls)
    async with operator_running(cluster.url):  # a restart on an unchanged world
        await asyncio.sleep(1.0)
    assert child_writes_since(kmock, mark) == set()


@pytest.mark.asyncio
async def test_without_leader_worker_set_installed_the_resource_says_so_and_waits(kmock, cluster, monkeypatch):
    """The API server answers 404 for a kind whose CRD is not installed: a clear condition, retried
    (not a permanent failure, not a crash), and the groups appear once it is installed."""
    monkeypatch.setattr("ucm_operator.handlers.RETRY_DELAY_S", 0.2)
    installed = False
    not_found = "the server could not find the requested resource"
    refuse_creates(kmock, "leaderworkersets", 404, not_found, until=lambda: installed)
    async with operator_running(cluster.url):
        await cluster.apply_ucmd(NS, "w", MULTI_NODE, uid="uid-w")

        cond = await degraded(cluster, "w", "MissingCRD")
        assert "LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) is not served by this cluster" in cond["message"]
        assert "https://lws.sigs.k8s.io" in cond["message"]
        installed = True

        async def groups() -> None:
            kids = await cluster.children(NS, "w")
            assert {("LeaderWorkerSet", "w-prefill-group"), ("LeaderWorkerSet", "w-decode-group")} <= set(kids)
            assert conditions(await cluster.ucmd(NS, "w"))["Degraded"]["status"] == "False"

        await eventually(groups)


ADAPTER_COMMIT = "0123456789abcdef0123456789abcdef01234567"
LORA_SPEC: dict[str, Any] = {
    **SPEC,
    "lora": {
        "adapters": [
            {"name": "sql", "source": {"pvc": {"claimName": "adapters", "path": "/sql"}}},
            {"name": "chat", "source": {"pvc": {"claimName": "adapters", "path": "/chat"}}},
            {"name": "tone", "source": {"hostPath": "/data/adapters/tone"}},
            {"name": "hub", "source": {"hf": "org/adapter", "revision": ADAPTER_COMMIT}},
        ],
        "maxAdapters": 2,
        "maxRank": 32,
    },
}


@pytest.mark.asyncio
async def test_adapters_reach_every_engine_of_both_pools_and_runtime_loading_only_where_allowed(kmock, cluster):
    runtime = {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"}
    with_runtime = {**LORA_SPEC, "decode": {**SPEC["decode"], "env": [runtime]}}
    policy = Policy(host_path_prefixes=("/data/adapters",), runtime_lora=(f"{NS}/allowed",))
    async with operator_running(cluster.url, policy):
        await cluster.apply_ucmd(NS, "l", LORA_SPEC, uid="uid-l")
        await cluster.apply_ucmd(NS, "allowed", with_runtime, uid="uid-allowed")
        await cluster.apply_ucmd(NS, "other", with_runtime, uid="uid-other")

        async def engine_pods(name: str) -> dict[str, dict[str, Any]]:
            kids = await cluster.children(NS, name)
            pools = ("prefill", "decode")
            return {pool: kids[("Deployment", f"{name}-{pool}")]["spec"]["template"]["spec"] for pool in pools}

        pods = await eventually(lambda: engine_pods("l"))
        commands = {pool: pod["containers"][0]["command"] for pool, pod in pods.items()}
        flags = {pool: c[c.index("--enable-lora") : c.index("--host")] for pool, c in commands.items()}
        assert flags["prefill"] == flags["decode"]
        modules = flags["decode"][flags["decode"].index("--lora-modules") + 1 :]
        assert [json.loads(m) for m in modules] == [
            {"name": "sql", "path": "/adapters/pvc/adapters/sql"},
            {"name": "chat", "path": "/adapters/pvc/adapters/chat"},
            {"name": "tone", "path": "/adapters/node/2"},
            {"name": "hub", "path": f"/adapters/hub/org--adapter--{ADAPTER_COMMIT}"},
        ]
        assert flags["decode"][:5] == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "32"]
        for pod in pods.values():
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes["lora-pvc-0"]["persistentVolumeClaim"] == {"claimName": "adapters"}
            assert volumes["lora-node-2"]["hostPath"] == {"path": "/data/adapters/tone", "type": "Directory"}
            mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
            assert mounts["lora-pvc-0"]["mountPath"] == "/adapters/pvc/adapters" and mounts["lora-pvc-0"]["readOnly"]
            (init,) = pod["initContainers"]
            assert init["command"] == [
                "python3",
                "-m",
                "ucm.deploy.lora",
                "org/adapter",
                ADAPTER_COMMIT,
                f"/adapters/hub/org--adapter--{ADAPTER_COMMIT}",
            ]

        # Runtime adapter loading: served where the policy names the deployment, refused elsewhere.
        allowed = await eventually(lambda: engine_pods("allowed"))
        assert runtime in allowed["decode"]["containers"][0]["env"]
        cond = await degraded(cluster, "other", "PolicyRefused")
        assert cond["message"].startswith("spec.decode.env[0].name: VLLM_ALLOW_RUNTIME_LORA_UPDATING is not allowed"), (
            cond["message"]
        )
        assert f"--allow-runtime-lora {NS}/other" in cond["message"]
        assert await cluster.children(NS, "other") == {}
