"""A ``UCMDeployment``'s status, computed from its spec and what its children report.

``Ready`` means every role has its ready replicas (the Deployment controller's count), never merely
that the objects were created. A condition keeps its ``lastTransitionTime`` until its value changes,
so recomputing an unchanged world yields an identical status and no write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ucm.deploy.plan import Plan

ROLE_CONDITIONS = {"prefill": "PrefillReady", "decode": "DecodeReady", "proxy": "ProxyReady"}


@dataclass(frozen=True)
class Child:
    """What the operator remembers of one child (from its watch)."""

    kind: str
    name: str
    component: str | None
    desired_hash: str | None
    ready: int = 0  # Deployments: ready replicas
    want: int = 0  # Deployments: replicas asked for
    settled: bool = True  # Deployments: the controller has seen the current generation
    phase: str | None = None  # PersistentVolumeClaims


def child_from(body: Mapping[str, Any], component: str | None, desired_hash: str | None) -> Child:
    meta, spec, status = body.get("metadata", {}), body.get("spec") or {}, body.get("status") or {}
    generation, observed = meta.get("generation"), status.get("observedGeneration")
    return Child(
        kind=body["kind"],
        name=meta["name"],
        component=component,
        desired_hash=desired_hash,
        ready=int(status.get("readyReplicas") or 0),
        want=int(spec.get("replicas", 1) or 0) if body["kind"] == "Deployment" else 0,
        settled=generation is None or observed is None or observed >= generation,
        phase=status.get("phase"),
    )


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    old: Mapping[str, Mapping[str, Any]], type_: str, ok: bool | None, reason: str, message: str, generation: int | None
) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    previous = old.get(type_) or {}
    changed = previous.get("status") != status
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": now()
        if changed or not previous.get("lastTransitionTime")
        else previous["lastTransitionTime"],
    }


def invalid_status(old_status: Mapping[str, Any], message: str, generation: int | None) -> dict[str, Any]:
    old = {c["type"]: c for c in old_status.get("conditions") or []}
    conds = [
        condition(old, "Ready", False, "InvalidSpec", message, generation),
        condition(old, "Progressing", False, "InvalidSpec", "nothing is applied until the spec is fixed", generation),
        condition(old, "Degraded", True, "InvalidSpec", message, generation),
    ]
    return {**dict(old_status), "conditions": conds, "observedGeneration": generation}


def computed_status(
    plan: Plan,
    namespace: str,
    proxy_port: int,
    store_external: str | None,
    children: Iterable[Child],
    old_status: Mapping[str, Any],
    generation: int | None,
    failure: str | None = None,
) -> dict[str, Any]:
    """The status for a valid spec. ``store_external`` explains a store nothing here can watch;
    ``failure`` is the last apply error, if any."""
    kids = list(children)
    by_component = {c.component: c for c in kids if c.kind == "Deployment"}
    old = {c["type"]: c for c in old_status.get("conditions") or []}
    conds = []
    ready_replicas: dict[str, int] = {}
    not_ready: list[str] = []
    for role in plan.roles:
        d = by_component.get(role.component)
        ready = d.ready if d else 0
        ok = d is not None and d.settled and d.want == role.replicas and ready >= role.replicas
        if role.component in ROLE_CONDITIONS:
            ready_replicas[role.component] = ready
            msg = f"{ready}/{role.replicas} ready"
            conds.append(
                condition(old, ROLE_CONDITIONS[role.component], ok, "Ready" if ok else "Waiting", msg, generation)
            )
        if not ok:
            not_ready.append(role.component)
    store_ok, store_reason, store_msg = _store(plan, by_component, kids, store_external)
    conds.append(condition(old, "StoreReady", store_ok, store_reason, store_msg, generation))
    if not store_ok:
        not_ready.append("store")
    ready = not not_ready and failure is None
    waiting = "waiting for " + ", ".join(dict.fromkeys(not_ready)) if not_ready else "all roles ready"
    conds.append(condition(old, "Ready", ready, "Ready" if ready else "Waiting", waiting, generation))
    conds.append(condition(old, "Progressing", not ready and failure is None, "Rollout", waiting, generation))
    conds.append(
        condition(
            old, "Degraded", failure is not None, "ApplyFailed" if failure else "AsExpected", failure or "", generation
        )
    )
    return {
        "conditions": conds,
        "readyReplicas": ready_replicas,
        "endpoint": f"http://{plan.name}-proxy.{namespace}.svc:{proxy_port}/v1",
        "observedGeneration": generation,
    }


def _store(
    plan: Plan, deployments: Mapping[str | None, Child], kids: list[Child], external: str | None
) -> tuple[bool, str, str]:
    if any(r.component == "mooncake-master" for r in plan.roles):
        master = deployments.get("mooncake-master")
        ok = master is not None and master.ready >= 1
        return ok, "Ready" if ok else "Waiting", "Mooncake master " + ("ready" if ok else "not ready yet")
    if plan.store_claim is not None:
        claim = next((c for c in kids if c.kind == "PersistentVolumeClaim"), None)
        phase = claim.phase if claim else None
        return (
            phase == "Bound",
            "Bound" if phase == "Bound" else "Waiting",
            f"claim {plan.name}-kv: {phase or 'Pending'}",
        )
    return True, "External", external or "external store"
