"""A ``UCMDeployment``'s status, computed from its plan and what its children report, as the typed
``UCMDeploymentStatus`` model (``ucm.deploy.spec``) and written as its camelCase dump.

``Ready`` means every role has its ready replicas (its workload controller's count), never merely
that the objects were created. ``PDPathHealthy`` and ``DisaggregationEffective`` come from what the
proxy last wrote into ``status.pdPath`` (its check through prefill, store and decode; see
``ucm_proxy.pdpath``): whether requests *can* and *do* use the store between the pools.

A condition keeps its ``lastTransitionTime`` until its value changes, so recomputing an unchanged
world yields an identical status and no write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ucm.deploy.autoscaling import autoscaling
from ucm.deploy.kubernetes import serving_pods
from ucm.deploy.roles import STORE_COMPONENTS, Plan
from ucm.deploy.spec import Condition, PDPathStatus, ReadyReplicas, UCMDeploymentStatus
from ucm_operator.api import ApiError

ROLE_CONDITIONS = {"prefill": "PrefillReady", "decode": "DecodeReady", "proxy": "ProxyReady"}
# What runs a role's pods: a Deployment, or for multi-pod engines a LeaderWorkerSet (whose ready
# replicas are groups with every pod ready).
WORKLOADS = ("Deployment", "LeaderWorkerSet")


@dataclass(frozen=True)
class Child:
    """What the operator remembers of one child (from its watch)."""

    kind: str
    name: str
    component: str | None
    desired_hash: str | None
    ready: int = 0  # workloads (Deployments, LeaderWorkerSets): ready replicas (groups of pods for the latter)
    want: int = 0  # workloads: replicas asked for
    settled: bool = True  # workloads: the controller has seen the current generation
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
        want=int(spec.get("replicas", 1) or 0) if body["kind"] in WORKLOADS else 0,
        settled=generation is None or observed is None or observed >= generation,
        phase=status.get("phase"),
    )


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Conditions:
    """Conditions built against the previous status, keeping unchanged transition times."""

    def __init__(self, old_status: Mapping[str, Any], generation: int | None) -> None:
        self.old = {c.get("type"): c for c in old_status.get("conditions") or []}
        self.generation = generation
        self.items: list[Condition] = []

    def add(self, type_: str, ok: bool | None, reason: str, message: str) -> None:
        status = "Unknown" if ok is None else ("True" if ok else "False")
        previous = self.old.get(type_) or {}
        kept = previous.get("status") == status and previous.get("lastTransitionTime")
        self.items.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                observed_generation=self.generation,
                last_transition_time=previous["lastTransitionTime"] if kept else now(),
            )
        )


def _dump(status: UCMDeploymentStatus) -> dict[str, Any]:
    # pdPath is the proxy's to write: a merge patch without it leaves it as the proxy wrote it.
    return status.model_dump(by_alias=True, mode="json", exclude={"pd_path"})


def invalid_status(old_status: Mapping[str, Any], reason: str, message: str, generation: int | None) -> dict[str, Any]:
    """Ready=False and Degraded=True for ``reason`` (InvalidSpec, PolicyRefused), naming the field;
    what the children reported is kept."""
    conds = Conditions(old_status, generation)
    conds.add("Ready", False, reason, message)
    conds.add("Progressing", False, reason, "nothing is applied until the spec is fixed")
    conds.add("Degraded", True, reason, message)
    return _dump(
        UCMDeploymentStatus(
            conditions=conds.items,
            ready_replicas=ReadyReplicas.model_validate(old_status.get("readyReplicas") or {}),
            endpoint=old_status.get("endpoint"),
            observed_generation=generation,
            decode_selector=old_status.get("decodeSelector", ""),
        )
    )


def computed_status(
    plan: Plan,
    namespace: str,
    proxy_port: int,
    children: Iterable[Child],
    old_status: Mapping[str, Any],
    generation: int | None,
    failure: ApiError | None = None,
    pd_path: Mapping[str, Any] | None = None,
    contested: Iterable[str] = (),
) -> dict[str, Any]:
    """The status for a valid spec; ``failure`` is the last apply error, if any; ``pd_path`` what
    the proxy last wrote; ``contested`` the children someone else keeps changing ("Deployment a-decode")."""
    kids = list(children)
    by_component = {c.component: c for c in kids if c.kind in WORKLOADS}
    conds = Conditions(old_status, generation)
    ready_replicas: dict[str, int] = {}
    not_ready: list[str] = []
    for role in plan.roles:
        d = by_component.get(role.component)
        ready = d.ready if d else 0
        # An autoscaled pool is ready at the count its autoscaler asks for, not the spec's.
        want = (d.want if d else 0) if autoscaling(role) else role.replicas
        ok = d is not None and d.settled and d.want == want and ready >= want
        if role.component in ROLE_CONDITIONS:
            ready_replicas[role.component] = ready
            conds.add(ROLE_CONDITIONS[role.component], ok, "Ready" if ok else "Waiting", f"{ready}/{want} ready")
        if not ok:
            not_ready.append(role.component)
    store_ok, store_reason, store_msg = _store(plan, by_component, kids)
    conds.add("StoreReady", store_ok, store_reason, store_msg)
    if not store_ok:
        not_ready.append("store")
    ready = not not_ready and failure is None
    waiting = "waiting for " + ", ".join(dict.fromkeys(not_ready)) if not_ready else "all roles ready"
    conds.add("Ready", ready, "Ready" if ready else "Waiting", waiting)
    conds.add("Progressing", not ready and failure is None, "Rollout", waiting)
    conds.add(
        "Degraded", failure is not None, failure.reason if failure else "AsExpected", str(failure) if failure else ""
    )
    fought = sorted(contested)
    conds.add(
        "Contested",
        bool(fought),
        "DriftFight" if fought else "AsExpected",
        f"{', '.join(fought)}: changed outside the UCMDeployment again and again; put back with backoff"
        if fought
        else "",
    )
    _pd_path(conds, pd_path)
    return _dump(
        UCMDeploymentStatus(
            conditions=conds.items,
            ready_replicas=ReadyReplicas(**ready_replicas),
            endpoint=f"http://{plan.name}-proxy.{namespace}.svc:{proxy_port}/v1",
            observed_generation=generation,
            decode_selector=",".join(f"{k}={v}" for k, v in serving_pods(plan.name, plan.role("decode")).items()),
        )
    )


def _pd_path(conds: Conditions, written: Mapping[str, Any] | None) -> None:
    try:
        path = PDPathStatus.model_validate(written) if written else None
    except ValueError:
        path = None  # not what a proxy of ours writes: as good as nothing
    if path is None:
        conds.add("PDPathHealthy", None, "NotChecked", "the proxy has not reported a PD path check yet")
        conds.add("DisaggregationEffective", None, "NotChecked", "the proxy has not reported yet")
        return
    by = f" (checked {path.checked_at or '?'}" + (f" by {path.reporter})" if path.reporter else ")")
    conds.add("PDPathHealthy", path.healthy, path.reason, path.message + by)
    conds.add("DisaggregationEffective", path.effective, path.effective_reason or "NotChecked", path.effective_message)


def _store(plan: Plan, deployments: Mapping[str | None, Child], kids: list[Child]) -> tuple[bool, str, str]:
    """A store the deployment runs is ready with its servers; one it claims when the claim is
    bound; one outside it is taken as it is."""
    servers = [r for r in plan.roles if r.component in STORE_COMPONENTS]
    if servers:
        ok = all((d := deployments.get(r.component)) is not None and d.ready >= 1 for r in servers)
        names = ", ".join(r.name for r in servers)
        return ok, "Ready" if ok else "Waiting", f"{names} " + ("ready" if ok else "not ready yet")
    if plan.store_claim is not None:
        claim = next((c for c in kids if c.kind == "PersistentVolumeClaim"), None)
        phase = claim.phase if claim else None
        bound = phase == "Bound"
        return bound, "Bound" if bound else "Waiting", f"claim {plan.name}-kv: {phase or 'Pending'}"
    return True, "External", plan.store_external or "external store"
