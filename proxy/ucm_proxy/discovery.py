"""Where backends come from besides fixed URLs, and the PD path check's result written back:
a file ``ucm up`` rewrites (``backends_file``), or the Kubernetes API — EndpointSlices (list,
then watch, per role's Service), and the resource's status.

Only ready endpoints are backends: a pod going away (readiness false, terminating) leaves the
pool before it stops serving. Needs list/watch on discovery.k8s.io endpointslices in the
namespace, and patch on its own UCMDeployment's status (the Role the operator gives the proxy's
ServiceAccount). The ServiceAccount token is read for every request: the kubelet rotates it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from ucm.config import ConfigError
from ucm_proxy.backends import Pool
from ucm_proxy.config import DiscoveryConfig, read_backends_file
from ucm_proxy.pdpath import PathCheck

logger = logging.getLogger("ucm_proxy.discovery")
SERVICE_LABEL = "kubernetes.io/service-name"
RESOURCE_API = "apis/ucm.io/v1alpha1"  # the UCMDeployment CRD's group and version (ucm.deploy.spec)
STATUS_HEARTBEAT_S = 300.0  # an unchanged check result is written again this often: readers see it is current


class Endpoints(NamedTuple):
    ready: list[str]  # base URLs, in a stable order
    starting: int  # endpoints listed but not ready yet (nor terminating): pods that exist


def slice_endpoints(slices: dict[str, dict[str, Any]], service: str, port_name: str) -> Endpoints:
    """The ready endpoints of the Service's EndpointSlices, and how many more are starting."""
    urls, starting = [], 0
    for name in sorted(slices):
        s = slices[name]
        if ((s.get("metadata") or {}).get("labels") or {}).get(SERVICE_LABEL) != service:
            continue  # the label selector also filters server-side; this keeps emulators honest
        ports = [p.get("port") for p in s.get("ports") or [] if p.get("name", "") == port_name]
        if not ports or ports[0] is None:
            continue
        for ep in s.get("endpoints") or []:
            conditions = ep.get("conditions") or {}
            if conditions.get("terminating") is True:
                continue
            if conditions.get("ready") is False:
                starting += 1
                continue
            for address in (ep.get("addresses") or [])[:1]:
                host = f"[{address}]" if ":" in address else address
                urls.append(f"http://{host}:{ports[0]}")
    return Endpoints(urls, starting)


async def watch_backends_file(proxy: Any, path: Path, interval_s: float = 0.25) -> None:
    """Follow a backends file: its writer replaces it whole (rename), so a change is one stat away.
    A file that turns unreadable or malformed leaves the pools as they were."""
    seen: int | None = None
    while True:
        changed: int | None = None
        try:
            changed = path.stat().st_mtime_ns
            if changed != seen:
                urls = read_backends_file(path)
                proxy.set_backends(urls)
                logger.info("backends from %s: prefill %s, decode %s", path, urls["prefill"], urls["decode"])
        except (OSError, ConfigError) as exc:
            if changed != seen:
                logger.warning("%s; keeping the backends as they are", exc)
        seen = changed
        await asyncio.sleep(interval_s)


class ApiServer:
    """Where the API server is and how to authenticate to it."""

    def __init__(self, config: DiscoveryConfig) -> None:
        self.config = config
        self.url = (
            config.api_server
            or "https://{}:{}".format(
                os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc"),
                os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
            )
        ).rstrip("/")
        self.ssl: ssl.SSLContext | bool = True
        if config.ca_path is not None and config.ca_path.exists():
            self.ssl = ssl.create_default_context(cafile=str(config.ca_path))

    def headers(self) -> dict[str, str]:
        path = self.config.token_path
        return {"Authorization": f"Bearer {path.read_text().strip()}"} if path.exists() else {}


async def watch_endpoints(proxy: Any, config: DiscoveryConfig) -> None:
    api = ApiServer(config)
    roles = [(proxy.decode, config.decode_service)]
    if config.prefill_service:
        roles.append((proxy.prefill, config.prefill_service))
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(
            *(_watch(session, api, config.namespace, service, config.port_name, pool) for pool, service in roles)
        )


async def _watch(
    session: aiohttp.ClientSession, api: ApiServer, namespace: str, service: str, port_name: str, pool: Pool
) -> None:
    url = f"{api.url}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
    selector = {"labelSelector": f"{SERVICE_LABEL}={service}"}
    backoff = 1.0
    while True:
        try:
            async with session.get(url, params=selector, ssl=api.ssl, headers=api.headers()) as r:
                r.raise_for_status()
                listing = await r.json()
            slices = {s["metadata"]["name"]: s for s in listing.get("items", [])}
            pool.set_urls(*slice_endpoints(slices, service, port_name))
            version = listing.get("metadata", {}).get("resourceVersion", "")
            params = {**selector, "watch": "true", "allowWatchBookmarks": "true"}
            if version:
                params["resourceVersion"] = version
            timeout = aiohttp.ClientTimeout(sock_read=300)
            async with session.get(url, params=params, ssl=api.ssl, headers=api.headers(), timeout=timeout) as w:
                w.raise_for_status()
                backoff = 1.0
                async for line in w.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    name = (obj.get("metadata") or {}).get("name")
                    if event.get("type") in ("ADDED", "MODIFIED") and name:
                        slices[name] = obj
                    elif event.get("type") == "DELETED" and name:
                        slices.pop(name, None)
                    elif event.get("type") == "ERROR":
                        break  # e.g. 410 Gone: list again
                    else:
                        continue
                    pool.set_urls(*slice_endpoints(slices, service, port_name))
        except asyncio.CancelledError:
            raise
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as exc:
            logger.warning("endpointslices of %s/%s: %s; retrying in %.0f s", namespace, service, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)


def write_pd_path(proxy: Any, config: DiscoveryConfig) -> Callable[[PathCheck], Awaitable[None]]:
    """A PathChecker listener: merge-patches ``status.pdPath`` of the proxy's UCMDeployment when
    the result changes (and every ``STATUS_HEARTBEAT_S``); the operator turns it into the
    ``PDPathHealthy`` and ``DisaggregationEffective`` conditions. A failed write is logged and
    tried again at the next check."""
    api = ApiServer(config)
    url = f"{api.url}/{RESOURCE_API}/namespaces/{config.namespace}/ucmdeployments/{config.resource}/status"
    written: dict[str, Any] = {"key": None, "at": 0.0}

    async def write(check: PathCheck) -> None:
        effective = proxy.recent.report(check)["effective"]
        key = (check.healthy, check.reason, effective["value"], effective["reason"])
        if key == written["key"] and time.monotonic() - written["at"] < STATUS_HEARTBEAT_S:
            return
        pd_path = {
            "healthy": check.healthy,
            "reason": check.reason,
            "message": check.message,
            "checkedAt": datetime.fromtimestamp(check.at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "effective": effective["value"],
            "effectiveReason": effective["reason"],
            "effectiveMessage": effective["message"],
            "reporter": os.environ.get("POD_NAME", ""),
        }
        headers = {**api.headers(), "Content-Type": "application/merge-patch+json"}
        body = json.dumps({"status": {"pdPath": pd_path}})
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.patch(url, data=body, headers=headers, ssl=api.ssl) as r,
            ):
                if r.status >= 300:
                    text = (await r.text())[:200]
                    logger.warning("writing status.pdPath of %s: %s %s", config.resource, r.status, text)
                    return
        except (TimeoutError, aiohttp.ClientError) as exc:
            logger.warning("writing status.pdPath of %s: %s", config.resource, exc or type(exc).__name__)
            return
        written.update(key=key, at=time.monotonic())

    return write
