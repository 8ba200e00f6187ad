"""Backends discovered from EndpointSlices, against kmock's in-memory Kubernetes API server."""

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from ucm_proxy.backends import Pool
from ucm_proxy.config import DiscoveryConfig, HealthConfig, RoutingConfig
from ucm_proxy.discovery import SERVICE_LABEL, Endpoints, slice_endpoints, watch_endpoints

NS = "serving"


def endpoint_slice(name: str, service: str, addresses: list[tuple[str, bool]], port: int = 8000) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": {SERVICE_LABEL: service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": ready}} for a, ready in addresses],
    }


def test_slice_endpoints_keeps_ready_endpoints_of_the_service_and_counts_starting_ones():
    slices = {
        "a": endpoint_slice("a", "decode", [("10.0.0.1", True), ("10.0.0.2", False)]),
        "b": endpoint_slice("b", "decode", [("fd00::3", True)]),
        "c": endpoint_slice("c", "prefill", [("10.0.0.9", True)]),
    }
    slices["a"]["endpoints"].append({"addresses": ["10.0.0.4"], "conditions": {"ready": True, "terminating": True}})
    assert slice_endpoints(slices, "decode", "http") == Endpoints(["http://10.0.0.1:8000", "http://[fd00::3]:8000"], 1)
    assert slice_endpoints(slices, "decode", "metrics") == Endpoints([], 0)
    assert slice_endpoints(slices, "gone", "http") == Endpoints([], 0)  # a pool scaled to zero


@pytest.mark.asyncio
async def test_pools_follow_endpointslices(kmock, tmp_path):
    url = str(kmock.url).rstrip("/")
    base = f"{url}/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
    routing, health = RoutingConfig(), HealthConfig()
    proxy = SimpleNamespace(
        prefill=Pool("prefill", [], "round_robin", routing, health),
        decode=Pool("decode", [], "round_robin", routing, health),
    )
    config = DiscoveryConfig(
        namespace=NS,
        prefill_service="pre",
        decode_service="dec",
        api_server=url,
        token_path=tmp_path / "no-token",
        ca_path=None,
    )

    async def urls(pool: Pool, want: list[str]) -> None:
        for _ in range(200):
            if [b.url for b in pool.backends] == want:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{pool.role}: {[b.url for b in pool.backends]} != {want}")

    async with aiohttp.ClientSession() as http:
        await (await http.post(base, json=endpoint_slice("dec-1", "dec", [("10.1.0.1", True)]))).release()
        task = asyncio.create_task(watch_endpoints(proxy, config))
        try:
            await urls(proxy.decode, ["http://10.1.0.1:8000"])
            await urls(proxy.prefill, [])
            await (await http.post(base, json=endpoint_slice("pre-1", "pre", [("10.2.0.1", True)]))).release()
            await urls(proxy.prefill, ["http://10.2.0.1:8000"])
            # a pod turns unready: it leaves the pool before it stops serving
            await (
                await http.patch(
                    f"{base}/dec-1",
                    json={
                        "endpoints": [
                            {"addresses": ["10.1.0.1"], "conditions": {"ready": False}},
                            {"addresses": ["10.1.0.2"], "conditions": {"ready": True}},
                        ]
                    },
                    headers={"Content-Type": "application/merge-patch+json"},
                )
            ).release()
            await urls(proxy.decode, ["http://10.1.0.2:8000"])
            assert proxy.decode.starting == 1 and not proxy.decode.at_zero
            await (await http.delete(f"{base}/pre-1")).release()
            await urls(proxy.prefill, [])
            assert proxy.prefill.at_zero  # no pod at all: scaled to zero
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
