"""Prometheus Operator objects for a deployment: a PodMonitor for its engines' ``/metrics`` (vLLM's
series and UCM's connector and store series, summed over the engine's processes) and a
ServiceMonitor for its proxy's (``ucm_proxy_*``, the PD path check included).

Rendered when the operator is told the Prometheus Operator is installed (chart values
``monitoring.prometheusOperator`` and ``monitoring.labels``; flags ``--prometheus-operator`` and
``--monitor-label``), with the labels its Prometheus selects monitors by. Prometheus reaches the
engines only if ``spec.monitoring.scrapers`` admits it (the engines' NetworkPolicy).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

API_VERSION = "monitoring.coreos.com/v1"
# Every series gets the deployment and the pool it came from, which the shipped rules and dashboard
# group by (ucm.deploy.rules); ``ucm up --monitor`` sets the same labels on its targets.
RELABELINGS = [
    {"sourceLabels": [f"__meta_kubernetes_pod_label_{label}"], "targetLabel": target}
    for label, target in (
        ("app_kubernetes_io_instance", "ucm_deployment"),
        ("app_kubernetes_io_component", "ucm_role"),
    )
]


@dataclass(frozen=True)
class Monitors:
    enabled: bool = False
    labels: tuple[tuple[str, str], ...] = ()  # what the Prometheus' podMonitorSelector/serviceMonitorSelector match
    interval: str = "30s"

    def render(
        self,
        meta: Callable[[str, str | None], dict[str, Any]],
        engines: dict[str, Any],
        proxy: dict[str, Any],
        proxy_token: dict[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """``meta(suffix, component)``: a child's metadata; ``engines`` and ``proxy``: label
        selectors of the engine pods and of the proxy's Service; ``proxy_token``: the Secret key
        (``name``, ``key``) of the bearer token the proxy's /metrics requires, if it requires one."""
        if not self.enabled:
            return []
        endpoint = {"port": "http", "path": "/metrics", "interval": self.interval, "relabelings": RELABELINGS}
        proxy_endpoint = endpoint
        if proxy_token is not None:
            proxy_endpoint = {**endpoint, "authorization": {"type": "Bearer", "credentials": proxy_token}}
        return [
            {
                "apiVersion": API_VERSION,
                "kind": "PodMonitor",
                "metadata": self._labelled(meta("engines", None)),
                "spec": {"selector": engines, "podMetricsEndpoints": [endpoint]},
            },
            {
                "apiVersion": API_VERSION,
                "kind": "ServiceMonitor",
                "metadata": self._labelled(meta("proxy", "proxy")),
                "spec": {"selector": proxy, "endpoints": [proxy_endpoint]},
            },
        ]

    def _labelled(self, meta: dict[str, Any]) -> dict[str, Any]:
        return {**meta, "labels": {**meta["labels"], **dict(self.labels)}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("what scrapes a deployment (ucm.deploy.monitors)")
    group.add_argument(
        "--prometheus-operator",
        action="store_true",
        help="render a PodMonitor for the engines and a ServiceMonitor for the proxy of each deployment",
    )
    group.add_argument(
        "--monitor-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label on those monitors, for the Prometheus' selectors (repeatable)",
    )


def from_args(args: argparse.Namespace) -> Monitors:
    labels = []
    for item in args.monitor_label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--monitor-label: {item!r} is not KEY=VALUE")
        labels.append((key, value))
    return Monitors(enabled=args.prometheus_operator, labels=tuple(labels))
