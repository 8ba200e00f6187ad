"""The Kopf handlers: a ``UCMDeployment`` in, its children and status out.

One handler per concern. ``reconcile`` (create/update/resume) turns the spec into a plan, the plan
into objects, and writes only the objects whose desired hash differs from what the watch last saw.
``child_changed`` recomputes the owner's status whenever a Deployment, LeaderWorkerSet or claim reports
progress. ``keep_child`` puts a child that was edited or deleted by hand back as the last reconcile
rendered it (``ucm_operator.drift``).
``remove`` takes the children down in the reverse of the plan's start order (proxy first, so
clients stop being routed before engines go). What the operator knows of its children comes from
Kopf indexes fed by its watches: a reconcile of an unchanged object reads nothing and writes nothing.

State shared by the handlers (the API client, what status was last written) lives in Kopf's memo:
``kopf.operator(registry=registry, memo=new_memo(...))``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
import yaml
from pydantic import ValidationError

from ucm.config import ConfigError, format_validation_error, parse_config
from ucm.deploy.kubernetes import (
    DESIRED_HASH,
    GENERATED_KEYS,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    Owner,
    render,
)
from ucm.deploy.plan import PROXY_CONFIG_FILE, build_plan
from ucm.deploy.policy import Policy
from ucm.deploy.roles import START_ORDER, Plan, PlanError, Site
from ucm.deploy.spec import GROUP, PLURAL, VERSION, UCMDeploymentSpec, deprecated_fields, read_spec
from ucm_operator.api import INSTALLED_WITH, KINDS, Api, ApiError, MissingKind, NameConflict, controlled_by
from ucm_operator.drift import NOT_REVERTED, Reverts, drifted
from ucm_operator.events import Events
from ucm_operator.metrics import RECONCILE_SECONDS, RECONCILES, WRITES
from ucm_operator.status import WORKLOADS, Child, child_from, computed_status, invalid_status
from ucm_proxy.config import ProxyConfig

MANAGED = {LABEL_MANAGED_BY: MANAGED_BY}
RETRY_DELAY_S = 15
DELETE_WAIT_S = 60  # per group of children (the pods' own grace periods are longer than that)
RELOOK_S = 1.0  # a child changed while its owner's reconcile writes: checked again this much later

logger = logging.getLogger(__name__)

registry = kopf.OperatorRegistry()


@dataclass
class State:
    """What the handlers share, in ``memo.ucm``. Status is written by one coroutine at a time per
    object and compared with what was last written (the watch's copy of the object may lag)."""

    api: Api
    server: str | None  # an API server to use without credentials (tests, development)
    policy: Policy = field(default_factory=Policy)  # what a resource may ask for
    locks: defaultdict[tuple[str, str], asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    written: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    failures: dict[tuple[str, str], ApiError] = field(default_factory=dict)
    pd_paths: dict[tuple[str, str], Any] = field(default_factory=dict)  # the proxy's status.pdPath, as reflected
    warned: dict[tuple[str, str], Any] = field(default_factory=dict)  # the generation whose old spellings were told
    # What the last reconcile rendered, per deployment: (kind, name) -> object; drift is measured against it.
    desired: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = field(default_factory=dict)
    applying: set[tuple[str, str]] = field(default_factory=set)  # deployments whose reconcile is writing
    reverts: dict[tuple[str, str, str], Reverts] = field(default_factory=dict)  # (kind, namespace, name)
    backing_off: set[tuple[str, str, str]] = field(default_factory=set)  # children with a later look scheduled
    looks: set[asyncio.Task[None]] = field(default_factory=set)  # those later looks (and rechecks')
    rechecks: set[tuple[str, str]] = field(default_factory=set)  # deployments with a status look scheduled
    events: Events = field(default_factory=Events)

    def forget(self, key: tuple[str, str]) -> None:
        for memo in (self.written, self.failures, self.locks, self.pd_paths, self.warned, self.desired):
            memo.pop(key, None)
        self.events.forget(*key)


def new_memo(server: str | None = None, policy: Policy | None = None) -> kopf.Memo:
    """The memo to run the operator with. ``server``: talk to this API server without credentials;
    default: in-cluster, then kubeconfig."""
    return kopf.Memo(ucm=State(Api(), server, policy or Policy()))


def _index_name(plural: str) -> str:
    return f"children_{plural}"


def _resource(group: str, version: str, plural: str) -> tuple[str, ...]:
    """A resource as Kopf's decorators take it: the core API group has no name."""
    return (group, version, plural) if group else (version, plural)


def _owner(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the handlers need of a UCMDeployment (an Event's object reference included)."""
    return {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec", "status")}


def children(indexes: Mapping[str, Any], namespace: str, name: str) -> list[Child]:
    out: list[Child] = []
    for _, _, plural in KINDS.values():
        out += list(indexes[_index_name(plural)].get((namespace, name), []))
    return out


@dataclass(frozen=True)
class Invalid:
    """Why a spec cannot be applied: ``InvalidSpec``, or ``PolicyRefused`` (valid, but outside what
    the operator's policy lets a resource ask for); the message names the field."""

    reason: str
    message: str


def plan_of(owner: Mapping[str, Any], policy: Policy) -> tuple[UCMDeploymentSpec, Plan] | Invalid:
    """The spec and its plan, or why it is unusable."""
    meta = owner["metadata"]
    try:
        spec = read_spec(dict(owner.get("spec") or {}))
    except ValidationError as exc:
        return Invalid("InvalidSpec", format_validation_error(exc, "spec"))
    try:
        policy.check(spec, meta["namespace"], meta["name"])
    except PlanError as exc:
        return Invalid("PolicyRefused", f"spec.{exc}")
    try:
        plan = build_plan(meta["name"], spec, Site("kubernetes", namespace=meta["namespace"]))
        # The proxy's own options are the proxy's to judge (the plan passes them through).
        parse_config(ProxyConfig, yaml.safe_load(plan.files[PROXY_CONFIG_FILE]), "spec.proxy.config")
    except ValidationError as exc:
        return Invalid("InvalidSpec", format_validation_error(exc, "spec"))
    except PlanError as exc:
        return Invalid("InvalidSpec", f"spec.{exc}")
    except ConfigError as exc:
        return Invalid("InvalidSpec", str(exc))
    return spec, plan


def ignored_replicas(spec: UCMDeploymentSpec, diff: Iterable[Any]) -> list[str]:
    """A pool's ``replicas`` changed (``kubectl scale``, an HPA on the resource, an edit) while its
    autoscaler decides the count: the change does nothing, which the user should hear."""
    messages = []
    for op, path, _, new in diff:
        if op != "change" or len(path) != 3 or path[0] != "spec" or path[2] != "replicas":
            continue
        pool = getattr(spec, path[1], None)
        scaling = getattr(pool, "autoscaling", None)
        if scaling is not None:
            messages.append(
                f"spec.{path[1]}.replicas changed to {new}, which does nothing: spec.{path[1]}.autoscaling sizes "
                f"the pool ({scaling.min_replicas} to {scaling.max_replicas}); change those, or remove it"
            )
    return messages


@kopf.on.login(registry=registry)
def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    state: State = memo.ucm
    if state.server is not None:
        info = kopf.ConnectionInfo(server=state.server, insecure=True)
    else:
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        state.api.connect(info)
    return info


@kopf.on.cleanup(registry=registry)
async def close(memo: kopf.Memo, **_: Any) -> None:
    await memo.ucm.api.close()


def _index_child(
    body: kopf.Body, namespace: str, labels: kopf.Labels, annotations: kopf.Annotations, **_: Any
) -> dict[tuple[str, str], Child] | None:
    instance = labels.get(LABEL_INSTANCE)
    if not instance:
        return None
    return {(namespace, instance): child_from(body, labels.get(LABEL_COMPONENT), annotations.get(DESIRED_HASH))}


for _group, _version, _plural in KINDS.values():
    kopf.index(*_resource(_group, _version, _plural), id=_index_name(_plural), labels=MANAGED, registry=registry)(
        _index_child
    )


@kopf.index(GROUP, VERSION, PLURAL, id="owners", registry=registry)
def owners(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, name): _owner(body)}


def status_for(
    owner: Mapping[str, Any],
    kids: list[Child],
    failure: ApiError | None,
    policy: Policy,
    pd_path: Mapping[str, Any] | None = None,
    contested: Iterable[str] = (),
) -> dict[str, Any]:
    meta = owner["metadata"]
    generation = meta.get("generation")
    old = owner.get("status") or {}
    planned = plan_of(owner, policy)
    if isinstance(planned, Invalid):
        return invalid_status(old, planned.reason, planned.message, generation)
    spec, plan = planned
    port = spec.proxy.service.port
    return computed_status(plan, meta["namespace"], port, kids, old, generation, failure, pd_path, contested)


async def refresh(state: State, namespace: str, name: str, indexes: Mapping[str, Any]) -> None:
    """Recompute the status from the live indexes; write it when it changed; post an Event when
    Ready or Degraded flips."""
    key = (namespace, name)
    async with state.locks[key]:
        found = list(indexes["owners"].get(key, []))
        if not found:
            return
        owner = found[0]
        old = state.written.get(key) or owner.get("status") or {}
        kids = children(indexes, namespace, name)
        pd_path = (owner.get("status") or {}).get("pdPath")  # the proxy's, from the watch
        fights = fighting(state, key)
        if fights:  # looked at again once the fight is over, to say so
            _refresh_later(state, indexes, key, min(fights.values()))
        failure = state.failures.get(key)
        new = status_for({**owner, "status": old}, kids, failure, state.policy, pd_path, fights)
        if {k: v for k, v in old.items() if k in new} == new:
            return
        try:
            await state.api.patch_status(namespace, name, new)
        except ApiError as exc:
            if exc.status == 404:
                return  # deleted meanwhile
            raise
        state.written[key] = new
    before = {c["type"]: c for c in old.get("conditions") or []}
    for cond in new["conditions"]:
        if cond["type"] not in ("Ready", "Degraded"):
            continue
        was = (before.get(cond["type"]) or {}).get("status")
        notable = cond["status"] == "True"  # Ready, or Degraded
        if was == cond["status"] or (was is None and not notable):
            continue  # unchanged, or a first status that says nothing happened
        text = f"{cond['type']}={cond['status']}" + (f": {cond['message']}" if cond["message"] else "")
        bad = (cond["type"] == "Degraded") == (cond["status"] == "True")
        state.events.post(owner, cond["reason"], text, warning=bad)


def fighting(state: State, key: tuple[str, str]) -> dict[str, float]:
    """The deployment's children someone else keeps changing ("Deployment a-decode"), each with the
    seconds until that fight counts as over if it stops now."""
    out: dict[str, float] = {}
    for kind, name in state.desired.get(key, {}):
        reverts = state.reverts.get((kind, key[0], name))
        if reverts is not None and (calm := reverts.calm_in()) > 0:
            out[f"{kind} {name}"] = calm
    return out


def _refresh_later(state: State, indexes: Mapping[str, Any], key: tuple[str, str], delay: float) -> None:
    if key in state.rechecks:
        return
    state.rechecks.add(key)

    async def later() -> None:
        await asyncio.sleep(delay + 0.1)
        state.rechecks.discard(key)
        await refresh(state, *key, indexes)

    task = asyncio.create_task(later())
    state.looks.add(task)
    task.add_done_callback(state.looks.discard)


@kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
@kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
@kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
async def reconcile(body: kopf.Body, name: str, namespace: str, uid: str, memo: kopf.Memo, **kwargs: Any) -> None:
    state: State = memo.ucm
    owner = _owner(body)
    planned = plan_of(owner, state.policy)
    if isinstance(planned, Invalid):
        # Nothing is touched: running pods keep serving the last valid spec.
        RECONCILES.labels("invalid").inc()
        await refresh(state, namespace, name, kwargs)
        return
    spec, plan = planned
    generation = (owner.get("metadata") or {}).get("generation")
    if state.warned.get((namespace, name)) != generation:  # once per spec, however often it is reconciled
        state.warned[(namespace, name)] = generation
        for message in deprecated_fields(owner.get("spec") or {}):
            state.events.post(owner, "DeprecatedField", message, warning=True)
        for message in ignored_replicas(spec, kwargs.get("diff") or ()):
            state.events.post(owner, "ReplicasIgnored", message, warning=True)
    desired = render(Owner(name, namespace, uid), spec, plan, state.policy.autoscaler, state.policy.monitors)
    state.desired[(namespace, name)] = {(o["kind"], o["metadata"]["name"]): o for o in desired if o["kind"] in KINDS}
    failure: ApiError | None = None
    state.applying.add((namespace, name))
    done: list[Change] = []
    with RECONCILE_SECONDS.time():
        try:
            await apply(state.api, desired, children(kwargs, namespace, name), done)
        except ApiError as exc:
            failure = exc
        finally:
            state.applying.discard((namespace, name))
            tell(state.events, owner, done)
    RECONCILES.labels("failed" if failure else "ok").inc()
    if failure is None:
        state.failures.pop((namespace, name), None)
    else:
        state.failures[(namespace, name)] = failure
    await refresh(state, namespace, name, kwargs)
    if failure is not None and failure.permanent:
        # Refused (e.g. 422 for an invalid env name): retrying changes nothing until the spec does.
        raise kopf.PermanentError(str(failure))
    if failure is not None:
        raise kopf.TemporaryError(str(failure), delay=RETRY_DELAY_S)


async def child_changed(labels: kopf.Labels, namespace: str, memo: kopf.Memo, **kwargs: Any) -> None:
    await refresh(memo.ucm, namespace, labels[LABEL_INSTANCE], kwargs)


@kopf.on.event(GROUP, VERSION, PLURAL, id="status_from_proxy", registry=registry)
async def pd_path_changed(
    type: str, name: str, namespace: str, status: kopf.Status, memo: kopf.Memo, **kwargs: Any
) -> None:
    """The proxy wrote status.pdPath: its conditions follow (other events recompute nothing new)."""
    state: State = memo.ucm
    key = (namespace, name)
    if type == "DELETED":
        state.pd_paths.pop(key, None)
        return
    if key in state.pd_paths and status.get("pdPath") == state.pd_paths[key]:
        return
    state.pd_paths[key] = status.get("pdPath")
    await refresh(state, namespace, name, kwargs)


for _kind in (*WORKLOADS, "PersistentVolumeClaim"):  # the children whose status ours depends on
    _group, _version, _plural = KINDS[_kind]
    kopf.on.event(
        *_resource(_group, _version, _plural), id=f"status_from_{_plural}", labels=MANAGED, registry=registry
    )(child_changed)


def _keeps(kind: str) -> Any:
    """The handler that keeps children of ``kind`` as rendered: each event of one is checked."""

    async def keep_child(
        type: str | None,
        body: kopf.Body,
        name: str,
        namespace: str,
        labels: kopf.Labels,
        memo: kopf.Memo,
        **kwargs: Any,
    ) -> None:
        state: State = memo.ucm
        key = (namespace, labels.get(LABEL_INSTANCE, ""))
        want = state.desired.get(key, {}).get((kind, name))
        if want is None:
            return  # not (or no longer) wanted
        if type == "DELETED" or drifted(want, dict(body)):
            await keep(state, kwargs, key, want)

    return keep_child


async def keep(
    state: State, indexes: Mapping[str, Any], key: tuple[str, str], want: dict[str, Any], waited: bool = False
) -> None:
    """Put a child back as rendered (recreate it if deleted), unless the fresh object already is;
    a child put back again and again is looked at less and less often (``Reverts``), with a
    Warning, rather than fought in a hot loop."""
    child = kind, namespace, name = child_key(key, want)
    if child in state.backing_off:
        return  # a later look is scheduled
    try:
        live: dict[str, Any] | None = await state.api.get(kind, namespace, name)
    except ApiError as exc:
        if exc.status != 404:
            logger.warning("%s %s/%s: not checked for drift: %s", kind, namespace, name, exc)
            return
        live = None
    if live is not None and (
        kind in NOT_REVERTED or not controlled_by(live, want["metadata"]["ownerReferences"][0]["uid"])
    ):
        return  # a claim (resizable, else immutable), or an object that is not ours
    paths = ["deleted"] if live is None else drifted(want, live)
    if not paths or key not in state.desired:
        return
    if key in state.applying:  # its reconcile is writing now: look again once it is done
        _look_later(state, indexes, key, want, RELOOK_S, waited=False)
        return
    found = list(indexes["owners"].get(key, []))
    owner = found[0] if found else None
    reverts = state.reverts.setdefault(child, Reverts())
    delay = 0.0 if waited else reverts.delay()
    what = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    if delay:
        if owner is not None:
            state.events.post(
                owner,
                "DriftFight",
                f"{kind} {name} keeps being changed outside the UCMDeployment ({what}); put back again "
                f"in {delay:.0f} s. Change the UCMDeployment instead, or stop what changes the {kind}",
                warning=True,
            )
        _look_later(state, indexes, key, want, delay, waited=True)
        await refresh(state, *key, indexes)  # Contested
        return
    if live is None:
        try:
            await state.api.create(want)
        except ApiError as exc:
            if exc.status != 409:  # 409: recreated meanwhile (or still terminating: its next event)
                raise
        WRITES.labels(kind, "create").inc()
    else:
        await state.api.patch(want)
        WRITES.labels(kind, "patch").inc()
    reverts.record()
    await refresh(state, *key, indexes)  # Contested, from the third revert within a minute
    if owner is not None:
        reason, message = (
            ("ChildRecreated", f"{kind} {name} was deleted; recreated")
            if live is None
            else ("DriftReverted", f"{kind} {name}: {what} changed outside the UCMDeployment; put back")
        )
        state.events.post(owner, reason, message)


def child_key(key: tuple[str, str], want: dict[str, Any]) -> tuple[str, str, str]:
    """(kind, namespace, name) of a rendered child of the deployment ``key``."""
    return want["kind"], key[0], want["metadata"]["name"]


def _look_later(
    state: State, indexes: Mapping[str, Any], key: tuple[str, str], want: dict[str, Any], delay: float, waited: bool
) -> None:
    """Check the child again in ``delay`` seconds (once: later events of it wait for that look)."""
    child = child_key(key, want)
    if child in state.backing_off:
        return
    state.backing_off.add(child)
    later = asyncio.create_task(_look_again(state, indexes, key, want, delay, waited))
    state.looks.add(later)  # held until done (the loop keeps weak references only)
    later.add_done_callback(state.looks.discard)


async def _look_again(
    state: State, indexes: Mapping[str, Any], key: tuple[str, str], want: dict[str, Any], delay: float, waited: bool
) -> None:
    await asyncio.sleep(delay)
    state.backing_off.discard(child_key(key, want))
    current = state.desired.get(key, {}).get((want["kind"], want["metadata"]["name"]))
    if current is not None:
        await keep(state, indexes, key, current, waited=waited)


for _kind, (_group, _version, _plural) in KINDS.items():
    kopf.on.event(*_resource(_group, _version, _plural), id=f"keep_{_plural}", labels=MANAGED, registry=registry)(
        _keeps(_kind)
    )


@kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
async def remove(body: kopf.Body, name: str, namespace: str, uid: str, memo: kopf.Memo, **kwargs: Any) -> None:
    """Children go group by group in the reverse of the start order — each group gone (as the
    watches report) before the next is deleted, so clients stop being routed before engines go —
    then the rest (config, claim). A claim without this deployment's owner reference (kept by
    ``store.pvc.create.whenDeleted: Retain``) stays."""
    state: State = memo.ucm
    for kind, child in state.desired.pop((namespace, name), {}):  # what goes now is not drift to put back
        state.reverts.pop((kind, namespace, child), None)
    kids = children(kwargs, namespace, name)
    for group in reversed(START_ORDER):
        stage = [c for c in kids if c.component in group]
        for c in stage:
            await state.api.delete(c.kind, namespace, c.name)
        await _gone(kwargs, namespace, name, {(c.kind, c.name) for c in stage})
    for c in kids:
        if any(c.component in group for group in START_ORDER):
            continue
        if c.kind == "PersistentVolumeClaim" and not await _owned(state.api, c, namespace, uid):
            message = f"PersistentVolumeClaim {c.name} kept (store.pvc.create.whenDeleted: Retain) with its KV blocks"
            state.events.post(_owner(body), "Retained", message + f"; a UCMDeployment named {name} here uses it again")
            continue
        await state.api.delete(c.kind, namespace, c.name)
    state.forget((namespace, name))


async def _owned(api: Api, child: Child, namespace: str, uid: str) -> bool:
    """Whether the live child carries the deployment's owner reference (gone: nothing to keep)."""
    try:
        return controlled_by(await api.get(child.kind, namespace, child.name), uid)
    except ApiError as exc:
        if exc.status == 404:
            return True
        raise


async def _gone(indexes: Mapping[str, Any], namespace: str, name: str, objects: set[tuple[str, str]]) -> None:
    """Until the watches no longer see ``objects`` (at most DELETE_WAIT_S: deletion goes on)."""
    deadline = asyncio.get_running_loop().time() + DELETE_WAIT_S
    while objects & {(c.kind, c.name) for c in children(indexes, namespace, name)}:
        if asyncio.get_running_loop().time() > deadline:
            logger.warning(
                "%s/%s: %s still present after %d s; deleting the rest", namespace, name, objects, DELETE_WAIT_S
            )
            return
        await asyncio.sleep(0.2)


async def _ensure_ours(api: Api, obj: dict[str, Any]) -> dict[str, Any]:
    """The live object named like ``obj``, if it is this deployment's; NameConflict if it is someone
    else's (the API's 404 if there is none). A claim a deployment of this name kept
    (``whenDeleted: Retain``: no owner reference, the deployment's labels) is this deployment's."""
    meta = obj["metadata"]
    existing = await api.get(obj["kind"], meta["namespace"], meta["name"])
    if "ownerReferences" in meta:
        ours = controlled_by(existing, meta["ownerReferences"][0]["uid"])
    else:
        labels = (existing.get("metadata") or {}).get("labels") or {}
        ours = all(labels.get(k) == v for k, v in meta["labels"].items())
    if not ours:
        raise NameConflict(obj["kind"], meta["namespace"], meta["name"])
    return existing


async def ensure_credentials(api: Api, obj: dict[str, Any], done: list[Change]) -> None:
    """The deployment's credentials Secret: created once with random keys; a key the spec needs
    later (store.mac turned on) is added; a key it holds is never changed (a rotation would need
    every engine and proxy restarted together)."""
    keys = obj["metadata"]["annotations"][GENERATED_KEYS].split(",")
    name = obj["metadata"]["name"]
    try:
        existing = await _ensure_ours(api, obj)
    except ApiError as exc:
        if exc.status != 404:  # a NameConflict (409) included
            raise
        await api.create({**obj, "stringData": {k: secrets.token_urlsafe(32) for k in keys}})
        WRITES.labels("Secret", "create").inc()
        done.append(Change("create", "Secret", name))
        return
    missing = [k for k in keys if k not in (existing.get("data") or {})]
    if not missing:
        return
    # A merge patch of stringData adds keys and leaves the others as they are.
    await api.patch({**obj, "stringData": {k: secrets.token_urlsafe(32) for k in missing}})
    WRITES.labels("Secret", "patch").inc()
    done.append(Change("patch", "Secret", name, f"keys {', '.join(missing)} added"))


@dataclass(frozen=True)
class Change:
    """One write ``apply`` made, as its Event tells it."""

    verb: str  # create, patch, scale, roll, delete
    kind: str
    name: str
    detail: str = ""


async def apply(api: Api, desired: list[dict[str, Any]], kids: list[Child], done: list[Change]) -> None:
    """Create or merge-patch what differs from the children seen; delete children no longer wanted
    (never a claim: deleting a spec field must not delete KV data). Each write made is appended to
    ``done`` (as it is made: a failure part-way leaves the writes before it told)."""
    seen = {(c.kind, c.name): c for c in kids}
    for obj in desired:
        if obj["kind"] == "Secret":
            await ensure_credentials(api, obj, done)
            continue
        kind, name = key = (obj["kind"], obj["metadata"]["name"])
        child = seen.pop(key, None)
        if child is not None and child.desired_hash == obj["metadata"]["annotations"][DESIRED_HASH]:
            continue
        if child is None:
            try:
                await api.create(obj)
                WRITES.labels(kind, "create").inc()
                done.append(Change("create", kind, name))
                continue
            except ApiError as exc:
                if exc.status == 404 and kind in INSTALLED_WITH:
                    raise MissingKind(kind, obj["metadata"]["namespace"]) from None
                if exc.status != 409:
                    raise
            # Created meanwhile by us (our watch is behind: patch it), or someone else's object.
            live = await _ensure_ours(api, obj)
        else:
            live = await api.get(kind, obj["metadata"]["namespace"], name) if kind in WORKLOADS else None
        if "ownerReferences" not in obj["metadata"]:  # a claim now kept on delete: drop its owner reference
            await api.patch({**obj, "metadata": {**obj["metadata"], "ownerReferences": None}})
        else:
            await api.patch(obj)
        WRITES.labels(kind, "patch").inc()
        done.extend(_patched(obj, live))
    namespace = desired[0]["metadata"]["namespace"]
    for kind, name in seen:
        if kind != "PersistentVolumeClaim":
            await api.delete(kind, namespace, name)
            WRITES.labels(kind, "delete").inc()
            done.append(Change("delete", kind, name))


def _patched(obj: dict[str, Any], live: Mapping[str, Any] | None) -> list[Change]:
    """A patch of a workload rolls its pods (its pod template changed), scales it (its replicas),
    or both; any other patch is an update."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    if live is None or kind not in WORKLOADS:
        return [Change("patch", kind, name)]
    changes = []
    template = drifted(obj["spec"].get("template", {}), (live.get("spec") or {}).get("template"), "spec.template")
    if template:
        what = ", ".join(template[:3]) + (f" and {len(template) - 3} more" if len(template) > 3 else "")
        changes.append(Change("roll", kind, name, what))
    had, wants = (live.get("spec") or {}).get("replicas"), obj["spec"].get("replicas")
    if wants is not None and had != wants:
        changes.append(Change("scale", kind, name, f"from {had} to {wants} replicas"))
    return changes or [Change("patch", kind, name)]


# verb -> (the Event's reason, its message before the children's names, after them)
GROUPED = {
    "create": ("Created", "Created ", ""),
    "patch": ("Updated", "Updated ", ""),
    "delete": ("Deleted", "Deleted ", ": no longer in the spec"),
}


def tell(events: Events, owner: Mapping[str, Any], done: list[Change]) -> None:
    """A reconcile's writes as Events: one per workload scaled or rolled (the decisions users look
    for), and one each for the children created, updated and deleted."""
    for c in done:
        if c.verb == "scale":
            events.post(owner, "Scaled", f"{c.kind} {c.name} scaled {c.detail}")
        elif c.verb == "roll":
            events.post(owner, "Rolled", f"{c.kind} {c.name}: its pod template changed ({c.detail}); its pods roll")
    for verb, (reason, before, after) in GROUPED.items():
        names = [f"{c.kind} {c.name}" + (f" ({c.detail})" if c.detail else "") for c in done if c.verb == verb]
        if names:
            listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            events.post(owner, reason, before + listed + after)
