"""The operator's decisions as Events on the UCMDeployment (created, scaled, rolled, updated,
deleted, refused by policy), rate-limited — the real operator on kmock, and the limiter alone."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest

from tests.operator.test_operator import NS, SPEC, created_and_ready, eventually
from ucm.deploy.autoscaling import Autoscaler
from ucm.deploy.policy import Policy
from ucm_operator.events import Events
from ucm_testing.kmock_operator import Emulator, operator_running, posted_events

pytestmark = pytest.mark.kmock(cls=Emulator)


def told(kmock, reason: str) -> list[str]:
    return [e["message"] for e in posted_events(kmock.calls) if e.get("reason") == reason]


@pytest.mark.asyncio
async def test_each_decision_is_an_event_users_can_grep(kmock, cluster):
    spec = copy.deepcopy(SPEC)
    async with operator_running(cluster.url, Policy(autoscaler=Autoscaler(provider="hpa"))):
        await created_and_ready(cluster, "a", spec)

        async def created() -> None:
            messages = told(kmock, "Created")
            assert len(messages) == 1, messages
            message = messages[0]
            assert message.startswith("Created ConfigMap a-config, Secret a-credentials, PersistentVolumeClaim a-kv")
            assert message.endswith(" more")  # 15 children: the first 8 named

        await eventually(created)

        spec["decode"]["replicas"] = 3
        await cluster.update_ucmd(NS, "a", spec, generation=2)
        await eventually(lambda: _has(kmock, "Scaled", ["Deployment a-decode scaled from 2 to 3 replicas"]))
        assert not told(kmock, "Rolled")  # a replica count rolls no pod

        spec["decode"]["env"] = [{"name": "NCCL_DEBUG", "value": "WARN"}]
        await cluster.update_ucmd(NS, "a", spec, generation=3)
        rolled = "Deployment a-decode: its pod template changed (spec.template.spec.containers[decode].env[NCCL_DEBUG]"
        await eventually(lambda: _starts(kmock, "Rolled", rolled))

        spec["decode"]["autoscaling"] = {"maxReplicas": 4}
        await cluster.update_ucmd(NS, "a", spec, generation=4)
        await eventually(lambda: _has(kmock, "Created", ["Created HorizontalPodAutoscaler a-decode"], at=1))
        spec["decode"].pop("autoscaling")
        await cluster.update_ucmd(NS, "a", {**spec, "decode": {**spec["decode"], "autoscaling": None}}, generation=5)
        gone = "Deleted HorizontalPodAutoscaler a-decode: no longer in the spec"
        await eventually(lambda: _has(kmock, "Deleted", [gone]))

        # Refused by the operator's policy: its own reason, a Warning.
        await cluster.apply_ucmd(NS, "h", {**SPEC, "image": {"repository": "evil/miner"}}, uid="uid-h")

        async def refused() -> None:
            events = [e for e in posted_events(kmock.calls) if e.get("reason") == "PolicyRefused"]
            assert len(events) == 1, events
            event = events[0]
            assert event["type"] == "Warning" and "spec.image.repository: evil/miner" in event["message"]

        await eventually(refused)


async def _has(kmock, reason: str, messages: list[str], at: int = 0) -> None:
    assert told(kmock, reason)[at:] == messages, told(kmock, reason)


async def _starts(kmock, reason: str, prefix: str) -> None:
    messages = told(kmock, reason)
    assert len(messages) == 1 and messages[0].startswith(prefix), messages


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def posted(monkeypatch) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kopf, "info", lambda obj, reason, message: out.append(("Normal", reason, message)))
    monkeypatch.setattr(kopf, "warn", lambda obj, reason, message: out.append(("Warning", reason, message)))
    return out


OWNER: dict[str, Any] = {"metadata": {"namespace": NS, "name": "a"}}


def test_a_repeated_message_waits_a_minute_and_a_burst_is_capped(posted):
    clock = Clock()
    events = Events(clock)
    assert events.post(OWNER, "Scaled", "same")
    assert not events.post(OWNER, "Scaled", "same")  # the same again at once: held back
    clock.now = Events.SAME_S
    assert events.post(OWNER, "Scaled", "same")
    assert posted[-1] == ("Normal", "Scaled", "same (1 more Events of this reason held back by the rate limit)")

    clock.now = 1000.0  # the bucket full again
    sent = [events.post(OWNER, "DriftFight", f"m{i}", warning=True) for i in range(Events.BURST + 3)]
    assert sent == [True] * Events.BURST + [False] * 3
    assert events.post({"metadata": {"namespace": NS, "name": "b"}}, "DriftFight", "m0")  # per object
    assert events.post(OWNER, "Rolled", "m0")  # and per reason
    clock.now += Events.REFILL_S  # one more token
    assert events.post(OWNER, "DriftFight", "later", warning=True)
    assert not events.post(OWNER, "DriftFight", "later still", warning=True)
    assert posted[-1] == ("Warning", "DriftFight", "later (3 more Events of this reason held back by the rate limit)")


def test_a_deleted_object_starts_with_a_full_bucket(posted):
    events = Events(Clock())
    for i in range(Events.BURST):
        events.post(OWNER, "Created", f"m{i}")
    assert not events.post(OWNER, "Created", "more")
    events.forget(NS, "a")
    assert events.post(OWNER, "Created", "more")
