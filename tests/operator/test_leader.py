"""Two real ``ucm-operator`` processes with leader election against kmock: one leads, the other
stands by answering health; kill -9 the leader and the standby takes over within 15 s, applying a
spec change made during the handover exactly once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest

from tests.operator.test_operator import NS, SPEC, created_and_ready, eventually, writes
from ucm.deploy.ports import free_port
from ucm_operator.api import Api
from ucm_operator.api import path as child_path
from ucm_operator.leader import LeaderElector, LeadershipLost, Timing, lease_path
from ucm_testing.kmock_operator import Driver, Emulator, posted_events

pytestmark = [pytest.mark.kmock(cls=Emulator), pytest.mark.engines]  # times the takeover
LEASE_NS = "ucm-system"
TAKEOVER_S = 15.0


class Replica:
    def __init__(self, name: str, url: str, tmp: Path, *extra: str) -> None:
        self.name = name
        self.health = f"http://127.0.0.1:{free_port()}/healthz"
        self.log_path = tmp / f"{name}.log"
        exe = Path(sys.executable).parent / "ucm-operator"
        args = [str(exe), "--server", url, "--liveness", self.health, "--leader-election"]
        args += ["--lease-namespace", LEASE_NS, "--identity", name, *extra]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=self._log)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def healthy(self) -> None:
        assert self.proc.poll() is None, self.log()
        async with aiohttp.ClientSession() as http:
            try:
                async with http.get(self.health) as r:
                    assert r.status == 200, await r.text()
            except aiohttp.ClientConnectionError as exc:
                raise AssertionError(str(exc)) from None

    async def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM, and its exit code (waiting without blocking the loop kmock serves from)."""
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self._log.close()
        return self.proc.poll()


@contextmanager
def replicas(url: str, tmp: Path, *names: str) -> Iterator[list[Replica]]:
    started = [Replica(name, url, tmp) for name in names]
    try:
        yield started
    finally:
        for r in started:
            if r.proc.poll() is None:
                r.proc.kill()
            r.proc.wait(30)


async def lease(cluster: Driver) -> dict[str, Any]:
    return await cluster.call("GET", lease_path(LEASE_NS, "ucm-operator"))


async def holder(cluster: Driver) -> str:
    spec = (await lease(cluster))["spec"]
    assert spec.get("holderIdentity"), spec
    return spec["holderIdentity"]


@pytest.mark.asyncio
async def test_the_standby_takes_over_within_15_s_and_applies_a_change_exactly_once(kmock, cluster, tmp_path):
    with replicas(cluster.url, tmp_path, "op-a", "op-b") as (a, b):
        leader_name = await eventually(lambda: holder(cluster), timeout=30)
        leader, standby = (a, b) if leader_name == "op-a" else (b, a)
        await eventually(standby.healthy, timeout=30)  # a standby answers its liveness probe
        await created_and_ready(cluster, "a")
        # Only the leader acts: the standby's log shows no handler.
        assert "took leadership" not in standby.log() and "Handler" not in standby.log(), standby.log()

        leader.proc.kill()  # kill -9: no release, the Lease has to expire
        died = time.monotonic()
        since = len(kmock.calls)
        changed = {**SPEC, "decode": {"replicas": 3}}
        await cluster.update_ucmd(NS, "a", changed, generation=2)

        async def scaled() -> None:
            deployment = await cluster.call("GET", child_path("Deployment", NS, "a-decode"))
            assert deployment["spec"]["replicas"] == 3

        await eventually(scaled, timeout=TAKEOVER_S + 15)
        took = time.monotonic() - died
        print(f"the standby reconciled the change {took:.1f} s after the leader died")
        assert took <= TAKEOVER_S, f"the standby took {took:.1f} s to reconcile\n{standby.log()}"
        assert await holder(cluster) == standby.name
        assert (await lease(cluster))["spec"]["leaseTransitions"] == 1
        told = [e for e in posted_events(kmock.calls) if e.get("reason") == "LeaderElection"]
        assert [e["message"] for e in told] == [f"{leader.name} became leader", f"{standby.name} became leader"]
        assert {e["involvedObject"]["kind"] for e in told} == {"Lease"}
        await asyncio.sleep(3)  # what a late or repeated write would take to show
        decode_patches = [w for w in writes(kmock, since) if w[1] == "deployments" and w[3].endswith("/a-decode")]
        assert len(decode_patches) == 1, decode_patches

        # A clean stop gives the Lease up at once.
        assert await standby.stop() == 0, standby.log()
        assert not (await lease(cluster))["spec"].get("holderIdentity")


@pytest.mark.asyncio
async def test_a_leader_that_cannot_renew_stops_before_its_lease_expires(kmock, cluster):
    """The fence: a leader cut off from the API server gives up after the renew deadline, which is
    shorter than the lease a standby waits out."""
    timing = Timing(lease_s=3.0, renew_s=1.0, retry_s=0.2)
    api = Api()
    api.connect(kopf.ConnectionInfo(server=cluster.url, insecure=True))
    me = LeaderElector(api, LEASE_NS, "fenced", "me", timing)
    started = time.monotonic()  # before its last renewal: the acquisition
    await me.acquire()
    refusal = kmock["patch"][lambda req: req.url.path.endswith("/leases/fenced")] << 503
    assert refusal is not None
    with pytest.raises(LeadershipLost, match="not renewed"):
        await asyncio.wait_for(me.hold(), 10)
    assert timing.renew_s <= time.monotonic() - started < timing.lease_s
    await api.close()


@pytest.mark.asyncio
async def test_two_electors_never_both_lead(kmock, cluster):
    """Both race for a fresh Lease and then for an expired one: one wins each time (409 for the other)."""
    timing = Timing(lease_s=1.0, renew_s=0.6, retry_s=0.1)
    electors = []
    for name in ("x", "y"):
        api = Api()
        api.connect(kopf.ConnectionInfo(server=cluster.url, insecure=True))
        electors.append(LeaderElector(api, LEASE_NS, "race", name, timing))
    won = await asyncio.gather(*(e._try() for e in electors))
    assert sorted(won) == [False, True]
    loser = electors[1] if won[0] else electors[0]
    assert not await loser._try()  # held and fresh
    await asyncio.sleep(timing.lease_s + 0.1)  # the winner stops renewing: its lease expires
    assert await loser._try()
    assert (await lease_of(cluster, "race"))["spec"]["holderIdentity"] == loser.identity
    for e in electors:
        await e.api.close()


async def lease_of(cluster: Driver, name: str) -> dict[str, Any]:
    return await cluster.call("GET", lease_path(LEASE_NS, name))


def test_timings_that_would_let_two_lead_are_refused():
    with pytest.raises(ValueError, match="renew deadline"):
        Timing(lease_s=5, renew_s=5, retry_s=1)
    r = subprocess.run(
        [str(Path(sys.executable).parent / "ucm-operator"), "--renew-deadline", "20"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "renew deadline (20.0) < lease duration (8.0)" in r.stderr, r.stderr
