"""Hand edits of the operator's children put back, deleted children recreated, what others own left
alone, and a child someone keeps changing backed off from — the real operator on kmock."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.operator.test_operator import NS, conditions, created_and_ready, eventually, writes
from ucm_operator.api import path as child_path
from ucm_operator.drift import Reverts, drifted
from ucm_testing.kmock_operator import Driver, Emulator, operator_running, posted_events

pytestmark = pytest.mark.kmock(cls=Emulator)


async def get(cluster: Driver, kind: str, name: str) -> dict[str, Any]:
    return await cluster.call("GET", child_path(kind, NS, name))


async def edit_container(cluster: Driver, name: str, **changes: Any) -> None:
    """``kubectl edit`` of the first container of a Deployment (a merge patch replaces the list)."""
    deployment = await get(cluster, "Deployment", name)
    containers = copy.deepcopy(deployment["spec"]["template"]["spec"]["containers"])
    containers[0].update(changes)
    body = {"spec": {"template": {"spec": {"containers": containers}}}}
    await cluster.call("PATCH", child_path("Deployment", NS, name), body)


def events(kmock, reason: str) -> list[dict[str, Any]]:
    return [e for e in posted_events(kmock.calls) if e.get("reason") == reason]


@pytest.mark.asyncio
async def test_hand_edits_of_each_owned_field_are_put_back(kmock, cluster):
    async with operator_running(cluster.url):
        await created_and_ready(cluster, "a")
        rendered = await get(cluster, "Deployment", "a-decode")
        engine = rendered["spec"]["template"]["spec"]["containers"][0]
        env = [{**e, "value": "x"} if "value" in e else e for e in engine["env"]]
        edits = {
            "image": {"image": "evil/vllm:latest"},
            "command": {"command": [*engine["command"], "--enforce-eager"]},
            "env": {"env": env},
        }
        for what, change in edits.items():
            await edit_container(cluster, "a-decode", **change)

            async def put_back(what: str = what) -> None:
                now = (await get(cluster, "Deployment", "a-decode"))["spec"]["template"]["spec"]["containers"][0]
                assert now[what] == engine[what], what

            await eventually(put_back)
        await cluster.call("PATCH", child_path("Deployment", NS, "a-decode"), {"spec": {"replicas": 7}})

        async def rescaled() -> None:
            assert (await get(cluster, "Deployment", "a-decode"))["spec"]["replicas"] == rendered["spec"]["replicas"]

        await eventually(rescaled)
        config = await get(cluster, "ConfigMap", "a-config")
        key = next(iter(config["data"]))
        await cluster.call("PATCH", child_path("ConfigMap", NS, "a-config"), {"data": {key: "tampered"}})

        async def config_back() -> None:
            assert (await get(cluster, "ConfigMap", "a-config"))["data"] == config["data"]

        await eventually(config_back)

        async def told() -> None:  # Kopf posts events from a queue of its own: a moment later
            reverted = [e["message"] for e in events(kmock, "DriftReverted")]
            assert any("spec.template.spec.containers[" in m and "].image" in m for m in reverted), reverted
            assert any("spec.replicas" in m for m in reverted) and any("ConfigMap a-config" in m for m in reverted)

        await eventually(told)


@pytest.mark.asyncio
async def test_deleted_children_are_recreated(kmock, cluster):
    async with operator_running(cluster.url):
        await created_and_ready(cluster, "a")
        for kind, name in (("NetworkPolicy", "a-engines"), ("Service", "a-decode"), ("Deployment", "a-prefill")):
            before = await get(cluster, kind, name)
            await cluster.call("DELETE", child_path(kind, NS, name))

            async def back(kind: str = kind, name: str = name, before: dict = before) -> None:
                now = await get(cluster, kind, name)
                assert now["spec"] == before["spec"] and now["metadata"]["uid"] != before["metadata"]["uid"]

            await eventually(back)

        async def told() -> None:  # Kopf posts events from a queue of its own: a moment later
            recreated = {e["message"] for e in events(kmock, "ChildRecreated")}
            assert "NetworkPolicy a-engines was deleted; recreated" in recreated
            assert "Deployment a-prefill was deleted; recreated" in recreated

        await eventually(told)


@pytest.mark.asyncio
async def test_what_others_own_is_left_alone_and_a_steady_state_writes_nothing(kmock, cluster):
    """An annotation another controller adds, an env var added by hand, the API server's defaults:
    not the operator's fields, so never written back."""
    async with operator_running(cluster.url):
        await created_and_ready(cluster, "a")
        engine = (await get(cluster, "Deployment", "a-decode"))["spec"]["template"]["spec"]["containers"][0]
        since = len(kmock.calls)
        await cluster.call(
            "PATCH", child_path("Deployment", NS, "a-decode"), {"metadata": {"annotations": {"other/controller": "x"}}}
        )
        await edit_container(cluster, "a-decode", env=[*engine["env"], {"name": "EXTRA", "value": "1"}])
        await cluster.call("PATCH", child_path("Service", NS, "a-proxy"), {"spec": {"clusterIP": "10.0.0.7"}})
        await cluster.play_deployment_controller(NS, "a")
        await eventually(lambda: _quiet(kmock, since), timeout=5)
        child_writes = [w for w in writes(kmock, since) if not w[1].startswith(("ucmdeployments", "events"))]
        assert child_writes == []
        now = await get(cluster, "Deployment", "a-decode")
        assert now["metadata"]["annotations"]["other/controller"] == "x"
        assert {"name": "EXTRA", "value": "1"} in now["spec"]["template"]["spec"]["containers"][0]["env"]


async def _quiet(kmock, since: int) -> None:
    import asyncio

    seen = len(kmock.calls)
    await asyncio.sleep(1.5)
    assert len(kmock.calls) == seen >= since


@pytest.mark.asyncio
async def test_a_child_someone_keeps_changing_is_backed_off_from_and_reported(kmock, cluster, monkeypatch):
    monkeypatch.setattr(Reverts, "FIRST_DELAY_S", 2.0)
    monkeypatch.setattr(Reverts, "WINDOW_S", 10.0)  # a fight is over after 10 s without a revert
    async with operator_running(cluster.url):
        await created_and_ready(cluster, "a")
        rendered = (await get(cluster, "Deployment", "a-decode"))["spec"]["replicas"]

        async def scale_and_see_it_back(n: int) -> None:
            await cluster.call("PATCH", child_path("Deployment", NS, "a-decode"), {"spec": {"replicas": n}})

            async def back() -> None:
                assert (await get(cluster, "Deployment", "a-decode"))["spec"]["replicas"] == rendered

            await eventually(back)

        for n in (5, 6, 7):
            await scale_and_see_it_back(n)
        assert not events(kmock, "DriftFight")
        await cluster.call("PATCH", child_path("Deployment", NS, "a-decode"), {"spec": {"replicas": 8}})

        async def reported() -> None:
            fights = events(kmock, "DriftFight")
            assert len(fights) == 1, fights
            fight = fights[0]
            assert fight["type"] == "Warning" and "Deployment a-decode keeps being changed" in fight["message"]
            assert "put back again in 2 s" in fight["message"]

        await eventually(reported)
        assert (await get(cluster, "Deployment", "a-decode"))["spec"]["replicas"] == 8  # not at once

        async def contested() -> dict[str, Any]:
            cond = conditions(await cluster.ucmd(NS, "a"))["Contested"]
            assert cond["status"] == "True" and cond["reason"] == "DriftFight", cond
            return cond

        assert (await eventually(contested))["message"].startswith("Deployment a-decode: changed outside")

        async def later() -> None:
            assert (await get(cluster, "Deployment", "a-decode"))["spec"]["replicas"] == rendered

        await eventually(later, timeout=10)

        async def over() -> None:
            cond = conditions(await cluster.ucmd(NS, "a"))["Contested"]
            assert cond["status"] == "False" and cond["reason"] == "AsExpected", cond

        await eventually(over, timeout=Reverts.WINDOW_S + 5)


def test_drift_is_measured_on_the_fields_the_operator_sets():
    want = {
        "metadata": {"labels": {"a": "1"}},
        "spec": {
            "replicas": 2,
            "template": {"spec": {"containers": [{"name": "engine", "image": "i", "args": ["--x"], "env": []}]}},
        },
    }
    have = copy.deepcopy(want)
    have["metadata"]["labels"]["other"] = "2"  # someone else's
    have["spec"]["template"]["spec"]["containers"].insert(0, {"name": "sidecar", "image": "s"})  # injected
    have["status"] = {"replicas": 2}
    assert drifted(want, have) == []
    have["spec"]["template"]["spec"]["containers"][1]["args"].append("--y")
    have["spec"]["replicas"] = 3
    assert drifted(want, have) == ["spec.replicas", "spec.template.spec.containers[engine].args"]
    del have["spec"]["template"]["spec"]["containers"][1]
    assert drifted(want, have) == ["spec.replicas", "spec.template.spec.containers[engine]"]


def test_a_fight_backs_off_exponentially_up_to_a_cap():
    r = Reverts()
    assert r.delay(0.0) == 0.0
    for t in (0.0, 1.0, 2.0):
        r.record(t)
    assert r.delay(3.0) == Reverts.FIRST_DELAY_S
    assert r.calm_in(3.0) == Reverts.WINDOW_S - 3.0  # the first of the three a minute old
    r.record(13.0)
    assert r.delay(14.0) == 2 * Reverts.FIRST_DELAY_S
    for t in range(20, 26):
        r.record(float(t))
    assert r.delay(26.0) == Reverts.MAX_DELAY_S
    assert r.delay(200.0) == 0.0 and r.calm_in(200.0) == 0.0  # quiet for a minute: forgiven
