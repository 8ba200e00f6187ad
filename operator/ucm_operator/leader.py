"""Leader election through a ``coordination.k8s.io/v1`` Lease, as Kubernetes' own controllers and
controller-runtime do it: the replicas of the operator race for one Lease; the holder runs the
handlers and renews it, the others wait, answering health and metrics.

Kopf's own peering was the other choice. It pauses operators by priority through a resource of
Kopf's (``KopfPeering``, a CRD more to install and grant) and has no fencing: a paused operator
that was partitioned away keeps running handlers until it sees the peering object again. With a
Lease the rules are the cluster's convention (``kubectl get lease`` shows the holder, the same RBAC
as every controller) and the fence is time: a leader that could not renew within ``renew_s`` stops
itself, before any standby may take the Lease (``lease_s`` after it last saw the Lease change,
by its own clock, so clocks need not agree).

Losing the Lease ends the process (``LeadershipLost``): a restarted pod starts as a standby with
nothing left of the old term's state, as controller-runtime's managers do.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ucm_operator.api import Api, ApiError

logger = logging.getLogger(__name__)


class LeadershipLost(RuntimeError):
    pass


@dataclass(frozen=True)
class Timing:
    """Takeover after a leader's death takes at most ``lease_s + retry_s`` (then Kopf's start)."""

    lease_s: float = 8.0  # a holder not heard from for this long is presumed gone
    renew_s: float = 6.0  # a leader that could not renew for this long stops (< lease_s: the fence)
    retry_s: float = 1.0  # how often the leader renews and a standby looks

    def __post_init__(self) -> None:
        if not 0 < self.retry_s < self.renew_s < self.lease_s:
            raise ValueError(
                f"leader election: need 0 < retry ({self.retry_s}) < renew deadline ({self.renew_s}) "
                f"< lease duration ({self.lease_s}) seconds"
            )


def lease_path(namespace: str, name: str | None = None) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases" + (f"/{name}" if name else "")


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # MicroTime, as the API stores it


class LeaderElector:
    def __init__(
        self,
        api: Api,
        namespace: str,
        name: str,
        identity: str,
        timing: Timing | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.timing = timing or Timing()
        self.clock = clock
        self._observed: tuple[Any, ...] | None = None  # the Lease's record when it last changed
        self._observed_at = 0.0  # by our clock
        self._renewed_at: float | None = None  # when we last held it, by our clock
        self._holder: str | None = None  # the holder the last look saw
        self._lease_uid: str | None = None

    @property
    def leading(self) -> bool:
        return self._renewed_at is not None

    async def acquire(self) -> None:
        """Until this replica holds the Lease."""
        announced = False
        while True:
            try:
                if await self._try():
                    break
            except ApiError as exc:  # the API server unreachable or refusing: look again
                logger.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            else:
                if not announced:
                    logger.info("standby: lease %s/%s is held by another replica", self.namespace, self.name)
                    announced = True
            await asyncio.sleep(self.timing.retry_s)
        logger.info("took leadership: lease %s/%s, identity %s", self.namespace, self.name, self.identity)
        await self._announce()

    async def hold(self) -> None:
        """Renew every ``retry_s``; raises LeadershipLost when the Lease went to another replica or
        could not be renewed for ``renew_s``."""
        while True:
            await asyncio.sleep(self.timing.retry_s)
            try:
                renewed = await self._try()
            except ApiError as exc:
                logger.warning("lease %s/%s: renewal failed: %s", self.namespace, self.name, exc)
                renewed = False
            if renewed:
                continue
            assert self._renewed_at is not None
            if self._holder != self.identity:
                raise LeadershipLost(f"lease {self.namespace}/{self.name} is now held by {self._holder}")
            if self.clock() - self._renewed_at >= self.timing.renew_s:
                raise LeadershipLost(f"lease {self.namespace}/{self.name} not renewed for {self.timing.renew_s:g} s")

    async def release(self) -> None:
        """Give the Lease up (a clean shutdown): a standby takes it on its next look instead of
        after ``lease_s``."""
        if not self.leading:
            return
        try:
            lease = await self.api.call("GET", lease_path(self.namespace, self.name))
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"] = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1}
                await self._write(lease)
        except ApiError as exc:
            logger.warning("lease %s/%s: not released (it expires): %s", self.namespace, self.name, exc)
        self._renewed_at = None

    async def _try(self) -> bool:
        """One look at the Lease: take or renew it where it is ours to take. True: we hold it."""
        now = self.clock()
        try:
            lease = await self.api.call("GET", lease_path(self.namespace, self.name))
        except ApiError as exc:
            if exc.status != 404:
                raise
            return await self._create(now)
        meta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        self._holder = holder
        record = (holder, spec.get("renewTime"), meta.get("resourceVersion"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or self.timing.lease_s)
        if holder not in (None, self.identity) and now - self._observed_at < duration:
            return False  # another replica's, and alive as far as we can tell
        stamp = _now_rfc3339()
        lease["spec"] = {
            **spec,
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.timing.lease_s),
            "renewTime": stamp,
            "acquireTime": spec.get("acquireTime") if holder == self.identity else stamp,
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (holder != self.identity),
        }
        try:
            written = await self._write(lease)
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        self._took(written, now)
        return True

    async def _announce(self) -> None:
        """An Event on the Lease, as client-go's leader election posts (``kubectl describe lease``);
        not posted is only logged: leading does not depend on it."""
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{self.name}.{secrets.token_hex(8)}", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "name": self.name,
                "namespace": self.namespace,
                "uid": self._lease_uid,
            },
            "reason": "LeaderElection",
            "message": f"{self.identity} became leader",
            "type": "Normal",
            "source": {"component": "ucm-operator"},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            await self.api.call("POST", f"/api/v1/namespaces/{self.namespace}/events", event)
        except ApiError as exc:
            logger.warning("lease %s/%s: leadership Event not posted: %s", self.namespace, self.name, exc)

    async def _write(self, lease: dict[str, Any]) -> Any:
        """A merge patch carrying the resourceVersion read: the API server applies it only if the
        Lease has not changed since (409 otherwise), so of two replicas writing, one wins."""
        body = {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]}, "spec": lease["spec"]}
        url = lease_path(self.namespace, self.name)
        return await self.api.call("PATCH", url, body, "application/merge-patch+json")

    async def _create(self, now: float) -> bool:
        stamp = _now_rfc3339()
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.timing.lease_s),
                "acquireTime": stamp,
                "renewTime": stamp,
                "leaseTransitions": 0,
            },
        }
        try:
            written = await self.api.call("POST", lease_path(self.namespace), lease)
        except ApiError as exc:
            if exc.status == 409:
                return False  # another replica created it first
            raise
        self._took(written, now)
        return True

    def _took(self, written: dict[str, Any] | None, now: float) -> None:
        spec = (written or {}).get("spec") or {}
        meta = (written or {}).get("metadata") or {}
        self._holder = self.identity
        self._lease_uid = meta.get("uid")
        self._observed, self._observed_at = (self.identity, spec.get("renewTime"), meta.get("resourceVersion")), now
        self._renewed_at = now
