"""The few Kubernetes API calls the operator makes for its children, over aiohttp.

Kopf does its own watching and bookkeeping; it has no public client for other objects, so this
small one reuses the credentials Kopf logged in with (``kopf.ConnectionInfo``)."""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from ucm.deploy.spec import GROUP, PLURAL, VERSION

# kind -> (API group, version, plural): every kind the operator renders.
KINDS: dict[str, tuple[str, str, str]] = {
    "ConfigMap": ("", "v1", "configmaps"),
    "Service": ("", "v1", "services"),
    "ServiceAccount": ("", "v1", "serviceaccounts"),
    "PersistentVolumeClaim": ("", "v1", "persistentvolumeclaims"),
    "Deployment": ("apps", "v1", "deployments"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "Role": ("rbac.authorization.k8s.io", "v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
    "HorizontalPodAutoscaler": ("autoscaling", "v2", "horizontalpodautoscalers"),
    # Watched whether or not KEDA is installed: Kopf serves it once its CRD exists.
    "ScaledObject": ("keda.sh", "v1alpha1", "scaledobjects"),
    # Likewise the Prometheus Operator's, rendered with --prometheus-operator.
    "PodMonitor": ("monitoring.coreos.com", "v1", "podmonitors"),
    "ServiceMonitor": ("monitoring.coreos.com", "v1", "servicemonitors"),
    # Multi-pod engines (parallel.nodes > 1), where LeaderWorkerSet is installed.
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
}
# Kinds a cluster serves only once their project is installed (its CRD): what to do when it is not.
INSTALLED_WITH = {
    "LeaderWorkerSet": "install LeaderWorkerSet (https://lws.sigs.k8s.io), or set parallel.nodes: 1 in every pool",
    "ScaledObject": "install KEDA, or run the operator with --autoscaler hpa",
    "PodMonitor": "install the Prometheus Operator, or run the operator without --prometheus-operator",
    "ServiceMonitor": "install the Prometheus Operator, or run the operator without --prometheus-operator",
}
# Rendered but not watched: the operator creates the credentials Secret once and never reads it
# back (RBAC: get and create on Secrets, no list or watch of every Secret in the namespace).
UNWATCHED: dict[str, tuple[str, str, str]] = {"Secret": ("", "v1", "secrets")}


class ApiError(Exception):
    """A call that failed: an error answer (``status``), or no answer at all (``status`` 0:
    a timeout or a connection error)."""

    reason = "ApplyFailed"  # the Degraded condition's reason

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: {status or 'no answer'} {message}".rstrip())
        self.status = status

    @property
    def permanent(self) -> bool:
        """The API server refuses the request itself (400, 403, 422, ...): asking again changes
        nothing until the spec does. Conflicts, throttling and timeouts are worth retrying."""
        return 400 <= self.status < 500 and self.status not in (408, 409, 429)


class NameConflict(ApiError):
    """A child's name is taken by an object this deployment does not control. The operator never
    adopts it: patching it would stamp our owner reference on it, and deleting the deployment
    would then delete it. Retried, since it resolves when the other object goes."""

    reason = "NameConflict"

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        super().__init__(
            409,
            "POST",
            path(kind, namespace),
            f"{kind} {namespace}/{name} already exists and is not controlled by this UCMDeployment; "
            "delete or rename it",
        )


class MissingKind(ApiError):
    """The cluster does not serve a kind the spec needs (its CRD is not installed). Retried: it
    resolves when the CRD is installed, with nothing else to change."""

    reason = "MissingCRD"

    def __init__(self, kind: str, namespace: str) -> None:
        group, version, _ = KINDS[kind]
        super().__init__(
            404,
            "POST",
            path(kind, namespace),
            f"{kind} ({group}/{version}) is not served by this cluster: {INSTALLED_WITH[kind]}",
        )

    @property
    def permanent(self) -> bool:
        return False


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def path(kind: str, namespace: str, name: str | None = None) -> str:
    group, version, plural = KINDS.get(kind) or UNWATCHED[kind]
    base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    return f"{base}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")


def status_path(namespace: str, name: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"


def _ssl(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    ctx = ssl.create_default_context(cafile=info.ca_path)
    if info.ca_data:
        ctx.load_verify_locations(cadata=base64.b64decode(info.ca_data).decode())
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        # ssl needs files; these live as long as the process.
        cert_file = tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False)  # noqa: SIM115
        key_file = tempfile.NamedTemporaryFile("wb", suffix=".key", delete=False)  # noqa: SIM115
        cert_file.write(base64.b64decode(info.certificate_data))
        key_file.write(base64.b64decode(info.private_key_data))
        cert_file.close()
        key_file.close()
        cert, key = cert_file.name, key_file.name
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


class Api:
    def __init__(self) -> None:
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None

    def connect(self, info: kopf.ConnectionInfo) -> None:
        self._info = info
        self._session = None  # a new login: new credentials on the next call

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._info is None:
            raise RuntimeError("not logged in to the Kubernetes API")
        if self._session is None or self._session.closed:
            headers = {}
            if self._info.token:
                headers["Authorization"] = f"{self._info.scheme or 'Bearer'} {self._info.token}"
            self._session = aiohttp.ClientSession(
                base_url=self._info.server.rstrip("/") + "/",
                headers=headers,
                connector=aiohttp.TCPConnector(ssl=_ssl(self._info)),
                timeout=aiohttp.ClientTimeout(total=30),
            )
        return self._session

    async def call(self, method: str, url: str, body: Any = None, content_type: str = "application/json") -> Any:
        try:
            async with self._http().request(
                method, url.lstrip("/"), json=body, headers={"Content-Type": content_type}
            ) as r:
                text = await r.text()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(0, method, url, f"{type(exc).__name__}: {exc}") from None
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None  # an error page from a proxy in front of the API server, say
        if status >= 400:
            message = data.get("message", "") if isinstance(data, dict) else text[:200]
            raise ApiError(status, method, url, message)
        return data

    async def create(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        await self.call("POST", path(obj["kind"], meta["namespace"]), obj)

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        return await self.call("GET", path(kind, namespace, name))

    async def patch(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        url = path(obj["kind"], meta["namespace"], meta["name"])
        await self.call("PATCH", url, obj, "application/merge-patch+json")

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            await self.call("DELETE", path(kind, namespace, name), {"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self.call("PATCH", status_path(namespace, name), {"status": status}, "application/merge-patch+json")
