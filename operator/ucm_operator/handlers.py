"""The Kopf handlers: a ``UCMDeployment`` in, its children and status out.

One handler per concern. ``reconcile`` (create/update/resume) turns the spec into a plan, the plan
into objects, and writes only the objects whose desired hash differs from what the watch last saw.
``child_changed`` recomputes the owner's status whenever a Deployment or claim reports progress.
``remove`` takes the children down proxy first, so clients stop being routed before engines go.
What the operator knows of its children comes from Kopf indexes fed by its watches: a reconcile of
an unchanged object reads nothing and writes nothing.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import kopf
from pydantic import ValidationError

from ucm.config import format_validation_error
from ucm.deploy.plan import PlanError, Site, build_plan
from ucm.deploy.spec import GROUP, PLURAL, VERSION, UCMDeploymentSpec
from ucm_operator.api import KINDS, Api, ApiError
from ucm_operator.metrics import RECONCILE_SECONDS, RECONCILES, WRITES
from ucm_operator.render import (
    DESIRED_HASH,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    Owner,
    render,
)
from ucm_operator.status import Child, child_from, computed_status, invalid_status

MANAGED = {LABEL_MANAGED_BY: MANAGED_BY}
# Deletion order: stop taking requests first, then the engines, then what they depend on.
DELETE_ORDER = ["proxy", "prefill", "decode", None, "mooncake-master", "store"]
RETRY_DELAY_S = 15


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


def build_registry(server: str | None = None) -> kopf.OperatorRegistry:
    """Handlers bound to one API connection. ``server``: talk to this API server without
    credentials (tests, local development); default: in-cluster, then kubeconfig."""
    registry = kopf.OperatorRegistry()
    api = Api()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if server is not None:
            info = kopf.ConnectionInfo(server=server, insecure=True)
        else:
            info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            api.connect(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await api.close()

    for group, version, plural in KINDS.values():

        def index_child(
            body: kopf.Body, namespace: str, labels: kopf.Labels, annotations: kopf.Annotations, **_: Any
        ) -> dict[tuple[str, str], Child] | None:
            instance = labels.get(LABEL_INSTANCE)
            if not instance:
                return None
            return {(namespace, instance): child_from(body, labels.get(LABEL_COMPONENT), annotations.get(DESIRED_HASH))}

        kopf.index(*_resource(group, version, plural), id=_index_name(plural), labels=MANAGED, registry=registry)(
            index_child
        )

    @kopf.index(GROUP, VERSION, PLURAL, id="owners", registry=registry)
    def owners(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
        return {(namespace, name): _owner(body)}

    # Status is written by one coroutine at a time per object, compared with what was last written
    # (the watch's copy of the object may lag behind our own write).
    locks: dict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
    written: dict[tuple[str, str], dict[str, Any]] = {}
    failures: dict[tuple[str, str], str] = {}

    async def refresh(namespace: str, name: str, indexes: Mapping[str, Any]) -> None:
        """Recompute the status from the live indexes; write it when it changed; post an Event
        when Ready or Degraded flips."""
        key = (namespace, name)
        async with locks[key]:
            found = list(indexes["owners"].get(key, []))
            if not found:
                return
            owner = found[0]
            old = written.get(key) or owner.get("status") or {}
            new = status_for({**owner, "status": old}, children(indexes, namespace, name), failures.get(key))
            if {k: v for k, v in old.items() if k in new} == new:
                return
            try:
                await api.patch_status(namespace, name, new)
            except ApiError as exc:
                if exc.status == 404:
                    return  # deleted meanwhile
                raise
            written[key] = new
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
            (kopf.warn if bad else kopf.info)(dict(owner), reason=cond["reason"], message=text)

    def plan_of(owner: Mapping[str, Any]) -> tuple[Any, Any, str | None]:
        """(spec model, plan, None), or (None, None, message naming the field)."""
        meta = owner["metadata"]
        try:
            spec = UCMDeploymentSpec.model_validate(dict(owner.get("spec") or {}))
            plan = build_plan(meta["name"], spec, Site("kubernetes", namespace=meta["namespace"]))
        except ValidationError as exc:
            return None, None, format_validation_error(exc, "spec")
        except PlanError as exc:
            return None, None, f"spec.{exc}"
        return spec, plan, None

    def status_for(owner: Mapping[str, Any], kids: list[Child], failure: str | None) -> dict[str, Any]:
        meta = owner["metadata"]
        generation = meta.get("generation")
        spec, plan, invalid = plan_of(owner)
        if invalid is not None:
            return invalid_status(owner.get("status") or {}, invalid, generation)
        store = spec.store
        external = {
            "nfs": f"NFS {store.nfs.server}:{store.nfs.path}" if store.nfs else None,
            "ds3fs": f"3FS mount {store.ds3fs.mount_path}" if store.ds3fs else None,
            "mooncake": f"external master {store.mooncake.address}" if store.mooncake else None,
            "posix": f"claim {store.pvc.claim_name}" if store.pvc else None,
        }[store.type]
        return computed_status(
            plan,
            meta["namespace"],
            spec.proxy.service.port,
            external,
            kids,
            owner.get("status") or {},
            generation,
            failure,
        )

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    async def reconcile(body: kopf.Body, name: str, namespace: str, uid: str, **kwargs: Any) -> None:
        owner = _owner(body)
        spec, plan, invalid = plan_of(owner)
        if invalid is not None:
            # Nothing is touched: running pods keep serving the last valid spec.
            RECONCILES.labels("invalid").inc()
            await refresh(namespace, name, kwargs)
            return
        desired = render(Owner(name, namespace, uid), spec, plan)
        failure = None
        with RECONCILE_SECONDS.time():
            try:
                await apply(api, desired, children(kwargs, namespace, name))
            except ApiError as exc:
                failure = str(exc)
        RECONCILES.labels("failed" if failure else "ok").inc()
        if failure is None:
            failures.pop((namespace, name), None)
        else:
            failures[(namespace, name)] = failure
        await refresh(namespace, name, kwargs)
        if failure is not None:
            raise kopf.TemporaryError(failure, delay=RETRY_DELAY_S)

    async def child_changed(labels: kopf.Labels, namespace: str, **kwargs: Any) -> None:
        await refresh(namespace, labels[LABEL_INSTANCE], kwargs)

    for kind in ("Deployment", "PersistentVolumeClaim"):  # the children whose status ours depends on
        group, version, plural = KINDS[kind]
        resource = _resource(group, version, plural)
        kopf.on.event(*resource, id=f"status_from_{plural}", labels=MANAGED, registry=registry)(child_changed)

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    async def remove(name: str, namespace: str, **kwargs: Any) -> None:
        kids = children(kwargs, namespace, name)
        for component in DELETE_ORDER:
            for c in kids:
                if c.component == component:
                    await api.delete(c.kind, namespace, c.name)
        for memo in (written, failures, locks):
            memo.pop((namespace, name), None)

    return registry


async def apply(api: Api, desired: list[dict[str, Any]], kids: list[Child]) -> int:
    """Create or merge-patch what differs from the children seen; delete children no longer wanted
    (never a claim: deleting a spec field must not delete KV data). Returns the writes made."""
    seen = {(c.kind, c.name): c for c in kids}
    writes = 0
    for obj in desired:
        key = (obj["kind"], obj["metadata"]["name"])
        child = seen.pop(key, None)
        if child is not None and child.desired_hash == obj["metadata"]["annotations"][DESIRED_HASH]:
            continue
        writes += 1
        if child is None:
            try:
                await api.create(obj)
                WRITES.labels(obj["kind"], "create").inc()
                continue
            except ApiError as exc:
                if exc.status != 409:  # created meanwhile (our watch is behind): patch it instead
                    raise
        await api.patch(obj)
        WRITES.labels(obj["kind"], "patch").inc()
    namespace = desired[0]["metadata"]["namespace"]
    for kind, name in seen:
        if kind != "PersistentVolumeClaim":
            writes += 1
            await api.delete(kind, namespace, name)
            WRITES.labels(kind, "delete").inc()
    return writes
