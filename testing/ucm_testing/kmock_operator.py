"""The real operator against kmock (an in-memory Kubernetes API server), for tests and benchmarks.

kmock runs no controllers: a test plays the Deployment controller by patching children's
``status``, and the API server's own fields (``uid``, ``generation``) by writing them itself.
Requests a test makes carry :data:`DRIVER_HEADER`, so what the operator did can be told apart.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import aiohttp
import aiohttp.web
import attrs
import kmock
import kopf

from ucm.deploy.policy import Policy
from ucm.deploy.spec import GROUP, KIND, PLURAL, VERSION
from ucm_operator.api import KINDS, UNWATCHED
from ucm_operator.api import path as child_path
from ucm_operator.handlers import new_memo, registry
from ucm_operator.status import WORKLOADS
from ucm_testing.k8s_protobuf import from_protobuf

DRIVER_HEADER = "X-UCM-Test-Driver"
VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete"}
WRITE_VERBS = {"create", "patch", "update", "delete"}
ALL_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


class Call(NamedTuple):
    """One resource request the operator made, as RBAC sees it."""

    group: str
    resource: str  # plural[/subresource]
    verb: str
    path: str
    data: Any


@attrs.frozen
class Conflict(kmock.KubernetesError):
    status: int = 409
    reason: str = "Conflict"
    message: str = "the object has been modified; apply your changes to the latest version and try again"


SERVER_SET_METADATA = frozenset({"uid", "resourceVersion", "generation", "creationTimestamp"})


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock plus what a real API server does on create (assign uid, resourceVersion, generation:
    Kopf tells objects apart by uid and tests its patches against resourceVersion) and on writes of
    Secrets (``stringData`` is write-only: stored base64-encoded in ``data``), and a compact record
    of the operator's calls in ``calls``.

    kmock matches every request against its whole request history (quadratic); ``history_limit``
    keeps only the latest requests there, for runs of thousands of calls."""

    history_limit: int | None = None
    calls: list[Call] = attrs.field(factory=list, init=False)
    call_times: list[float] = attrs.field(factory=list, init=False)  # time.perf_counter() of each of calls
    _lease_writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.method.value == "PUT" and request.name is not None and isinstance(request.data, dict):
            replace = self._as_replace(request)
            try:
                await self._handle_write(replace)
            except NotImplementedError:  # written, but kmock's reactions answer PATCH, not PUT
                key = (replace.resource, replace.namespace, replace.name)
                return aiohttp.web.json_response(self._objects[key].raw)
        if request.resource is not None and request.resource.plural == "leases" and request.method.value == "PATCH":
            async with self._lease_writes:  # the check and the write as one step
                self._precondition(request)
                return await self._handle_write(request)
        return await self._handle_write(request)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if "protobuf" in raw_request.headers.get("Content-Type", ""):
            raw_request = await _as_json(raw_request)
        return await super().__call__(raw_request)

    async def _serve_version(self, request: kmock.Request) -> Any:
        """kmock names the core group's version ``/v1``; client-go (helm, kubectl) then maps no
        core kind ("no matches for kind ServiceAccount in version v1"). A real server says ``v1``."""
        doc = await super()._serve_version(request)
        doc["groupVersion"] = doc["groupVersion"].removeprefix("/")
        return doc

    def _as_replace(self, request: kmock.Request) -> kmock.Request:
        """A PUT (client-go's update: helm's release records) as the merge patch that makes the
        stored object the body: kmock serves PATCH only."""
        key = (request.resource, request.namespace, request.name)
        old = dict(self._objects[key]) if key in self._objects and not self._objects[key].deleted else {}
        kept = {k: v for k, v in old.get("metadata", {}).items() if k in SERVER_SET_METADATA}
        new = {**request.data, "metadata": {**request.data.get("metadata", {}), **kept}}
        return attrs.evolve(request, action=kmock.action.UPDATE, data=_replacing(old, new))

    def _precondition(self, request: kmock.Request) -> None:
        """A patch carrying the resourceVersion it read fails with 409 when the object changed
        since, and bumps it otherwise: the optimistic concurrency leader election relies on
        (kmock keeps no resourceVersion; only Leases get it here, as nothing else needs it)."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted or not isinstance(request.data, dict):
            return
        current = self._objects[key]
        seen = current.get("metadata", {}).get("resourceVersion", "1")
        meta = request.data.setdefault("metadata", {})
        if meta.get("resourceVersion", seen) != seen:
            raise Conflict()
        meta["resourceVersion"] = str(int(seen) + 1)

    async def _handle_write(self, request: kmock.Request) -> Any:
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("resourceVersion", "1")
            meta.setdefault("generation", 1)
        if isinstance(request.data, dict) and request.data.get("kind") == "Secret" and "stringData" in request.data:
            plain = request.data.pop("stringData")
            encoded = {k: base64.b64encode(v.encode()).decode() for k, v in plain.items()}
            request.data["data"] = {**request.data.get("data", {}), **encoded}
        call = _as_call(request)
        if call is not None:
            self.calls.append(call)
            self.call_times.append(time.perf_counter())
        if self.history_limit is not None and len(self._requests) > 2 * self.history_limit:
            del self._requests[: -self.history_limit]
        return await super()._handle(request)


async def _as_json(raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.BaseRequest:
    """A protobuf body (client-go's for core kinds: helm's release Secrets) as the JSON kmock reads."""
    json_request = raw_request.clone(headers={**raw_request.headers, "Content-Type": "application/json"})
    try:
        obj = from_protobuf(await raw_request.read())
    except ValueError as exc:
        raise aiohttp.web.HTTPUnsupportedMediaType(text=f"the emulator cannot read this protobuf body: {exc}") from None
    json_request._read_bytes = json.dumps(obj).encode()  # aiohttp's buffer of the body, read once
    return json_request


def _replacing(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns ``old`` into ``new`` (keys only ``old`` has set to null)."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        was = old.get(key)
        patch[key] = _replacing(was, value) if isinstance(was, dict) and isinstance(value, dict) else value
    return patch


def _as_call(req: kmock.Request) -> Call | None:
    if DRIVER_HEADER in req.headers or req.resource is None or req.resource.plural is None:
        return None  # the test's own calls; discovery (non-resource URLs, open to every user)
    action = req.action.value if req.action else ""
    verb = VERBS.get(action) or {"PATCH": "patch", "PUT": "update"}.get(req.method.value, req.method.value)
    resource = req.resource.plural + (f"/{req.subresource}" if req.subresource else "")
    return Call(req.resource.group or "", resource, verb, req.url.path, req.data if verb == "create" else None)


def declare(k: kmock.KubernetesEmulator) -> None:
    """Every resource the operator and Kopf use, so that API discovery finds them."""
    k.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
        kind=KIND, namespaced=True, subresources={"status"}, shortnames={"ucmd"}, verbs=ALL_VERBS
    )
    for kind, (group, version, plural) in {**KINDS, **UNWATCHED}.items():
        key = f"{group}/{version}/{plural}" if group else f"{version}/{plural}"
        k.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=True, subresources={"status"}, verbs=ALL_VERBS)
    k.resources["coordination.k8s.io/v1/leases"] = kmock.ResourceInfo(kind="Lease", namespaced=True, verbs=ALL_VERBS)
    k.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs=ALL_VERBS)
    k.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=ALL_VERBS)
    k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=ALL_VERBS
    )


def ucmd_path(namespace: str, name: str | None = None) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}" + (f"/{name}" if name else "")


class Driver:
    """What a test does to the cluster (the user and the controllers kmock does not run)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        # No keep-alive: a pooled connection to kmock goes stale when an operator stops.
        self.http = aiohttp.ClientSession(
            headers={DRIVER_HEADER: "1"},
            timeout=aiohttp.ClientTimeout(total=10),
            connector=aiohttp.TCPConnector(force_close=True),
        )

    async def close(self) -> None:
        await self.http.close()

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.http.request(method, self.url + path, json=body, headers=headers) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise AssertionError(f"{method} {path}: {r.status} {data}")
            return data

    async def apply_ucmd(self, namespace: str, name: str, spec: dict[str, Any], uid: str, generation: int = 1) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid,
                "generation": generation,
            },
            "spec": spec,
        }
        await self.call("POST", ucmd_path(namespace), body)

    async def update_ucmd(self, namespace: str, name: str, spec: dict[str, Any], generation: int) -> None:
        """A spec change, with the generation bump the API server would make."""
        await self.call("PATCH", ucmd_path(namespace, name), {"spec": spec, "metadata": {"generation": generation}})

    async def ucmd(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.call("GET", ucmd_path(namespace, name))

    async def children(self, namespace: str, name: str) -> dict[tuple[str, str], dict[str, Any]]:
        out = {}
        for kind in {**KINDS, **UNWATCHED}:
            listing = await self.call("GET", child_path(kind, namespace))
            for obj in listing.get("items") or []:
                if (obj["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") == name:
                    out[(kind, obj["metadata"]["name"])] = obj
        return out

    async def play_deployment_controller(self, namespace: str, name: str, ready: bool = True) -> None:
        """Report every Deployment (and LeaderWorkerSet: its groups) of ``name`` (un)ready, as their
        controllers would once pods run."""
        for (kind, child), obj in (await self.children(namespace, name)).items():
            if kind in WORKLOADS:
                n = obj["spec"].get("replicas", 1) if ready else 0  # the API server's default
                status = {"replicas": n, "readyReplicas": n, "updatedReplicas": n}
                if kind == "Deployment":  # a LeaderWorkerSet's status has no observedGeneration
                    status["observedGeneration"] = 1
                await self.call("PATCH", child_path(kind, namespace, child) + "/status", {"status": status})
            elif kind == "PersistentVolumeClaim":
                await self.call("PATCH", child_path(kind, namespace, child) + "/status", {"status": {"phase": "Bound"}})


def posted_events(calls: Iterable[Call]) -> list[dict[str, Any]]:
    """Events the operator posted. (kmock does not fill ``generateName``, so it stores only the first
    of them; the requests are the record.)"""
    return [c.data for c in calls if c.resource == "events" and c.verb == "create"]


def allowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(
        group in r.get("apiGroups", []) and resource in r.get("resources", []) and verb in r.get("verbs", [])
        for r in rules
    )


@asynccontextmanager
async def operator_running(url: str, policy: Policy | None = None) -> AsyncIterator[None]:
    """The real operator (Kopf, this package's handlers) until the block exits."""
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry,
            memo=new_memo(server=url, policy=policy),
            standalone=True,
            clusterwide=True,
            stop_flag=stop,
            ready_flag=ready,
        )
    )
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # raises why it stopped
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@asynccontextmanager
async def emulator(history_limit: int | None = None) -> AsyncIterator[Emulator]:
    """kmock outside pytest (the benchmark)."""
    async with Emulator(history_limit=history_limit) as k, kmock.Server(k):
        declare(k)
        yield k
