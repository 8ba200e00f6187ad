"""Backends from Kubernetes EndpointSlices: list, then watch, per role's Service.

Only ready endpoints are backends: a pod going away (readiness false, terminating) leaves the
pool before it stops serving. Needs list/watch on discovery.k8s.io endpointslices in the
namespace (the Role the operator gives the proxy's ServiceAccount).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from typing import Any

import aiohttp

from ucm_proxy.backends import Pool
from ucm_proxy.config import DiscoveryConfig

logger = logging.getLogger("ucm_proxy.discovery")
SERVICE_LABEL = "kubernetes.io/service-name"


def slice_urls(slices: dict[str, dict[str, Any]], service: str, port_name: str) -> list[str]:
    """Base URLs of the ready endpoints of the Service's EndpointSlices, in a stable order."""
    urls = []
    for name in sorted(slices):
        s = slices[name]
        if ((s.get("metadata") or {}).get("labels") or {}).get(SERVICE_LABEL) != service:
            continue  # the label selector also filters server-side; this keeps emulators honest
        ports = [p.get("port") for p in s.get("ports") or [] if p.get("name", "") == port_name]
        if not ports or ports[0] is None:
            continue
        for ep in s.get("endpoints") or []:
            conditions = ep.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            for address in (ep.get("addresses") or [])[:1]:
                host = f"[{address}]" if ":" in address else address
                urls.append(f"http://{host}:{ports[0]}")
    return urls


async def watch_endpoints(proxy: Any, config: DiscoveryConfig) -> None:
    api = config.api_server or "https://{}:{}".format(
        os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc"),
        os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
    )
    headers = {}
    if config.token_path.exists():
        headers["Authorization"] = f"Bearer {config.token_path.read_text().strip()}"
    ssl_ctx: ssl.SSLContext | bool = True
    if config.ca_path is not None and config.ca_path.exists():
        ssl_ctx = ssl.create_default_context(cafile=str(config.ca_path))
    roles = [(proxy.decode, config.decode_service)]
    if config.prefill_service:
        roles.append((proxy.prefill, config.prefill_service))
    async with aiohttp.ClientSession(headers=headers) as session:
        await asyncio.gather(
            *(
                _watch(session, api, ssl_ctx, config.namespace, service, config.port_name, pool)
                for pool, service in roles
            )
        )


async def _watch(
    session: aiohttp.ClientSession, api: str, ssl_ctx: Any, namespace: str, service: str, port_name: str, pool: Pool
) -> None:
    url = f"{api.rstrip('/')}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
    selector = {"labelSelector": f"{SERVICE_LABEL}={service}"}
    backoff = 1.0
    while True:
        try:
            async with session.get(url, params=selector, ssl=ssl_ctx) as r:
                r.raise_for_status()
                listing = await r.json()
            slices = {s["metadata"]["name"]: s for s in listing.get("items", [])}
            pool.set_urls(slice_urls(slices, service, port_name))
            version = listing.get("metadata", {}).get("resourceVersion", "")
            params = {**selector, "watch": "true", "allowWatchBookmarks": "true"}
            if version:
                params["resourceVersion"] = version
            async with session.get(url, params=params, ssl=ssl_ctx, timeout=aiohttp.ClientTimeout(sock_read=300)) as w:
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
                    pool.set_urls(slice_urls(slices, service, port_name))
        except asyncio.CancelledError:
            raise
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as exc:
            logger.warning("endpointslices of %s/%s: %s; retrying in %.0f s", namespace, service, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
