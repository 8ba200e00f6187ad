"""Prometheus rules for UCM: recording rules under UCM's documented metric names and the alerts
that matter for a PD deployment.

Every series is aggregated ``by (namespace, ucm_deployment)``: the chart's PodMonitor and
ServiceMonitor and ``ucm up --monitor``'s scrape configuration put ``ucm_deployment`` (and
``ucm_role``: prefill, decode, proxy) on each target; locally there is no ``namespace`` label and
the grouping simply leaves it out. One rules file serves every deployment (the chart's
PrometheusRule, ``ucm up --monitor``); ``python -m ucm.deploy.rules FILE`` writes it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BY = "namespace, ucm_deployment"
WINDOW = "5m"


def _rate(series: str, by: str = BY) -> str:
    return f"sum by ({by}) (rate({series}[{WINDOW}]))"


def _quantile(q: str, bucket: str, by: str = BY) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({bucket}[{WINDOW}])))"


def _share(part: str, whole: str) -> str:
    """Of the proxy's requests matching ``whole``, the fraction matching ``part`` too (0, not
    nothing, while none does)."""
    total = _rate(f"ucm_proxy_requests_total{{{whole}}}" if whole else "ucm_proxy_requests_total")
    return f"({_rate(f'ucm_proxy_requests_total{{{part}}}')} or {total} * 0) / {total}"


@dataclass(frozen=True)
class Record:
    name: str
    expr: str
    labels: dict[str, str] = field(default_factory=dict)

    def rule(self) -> dict[str, Any]:
        return {"record": self.name, "expr": self.expr, **({"labels": self.labels} if self.labels else {})}


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


_STORE_BY = f"{BY}, backend"  # a DRAM tier in front of a file store counts its own lookups and bytes

RECORDS = [
    # Of the block ids engines looked up in the store, the fraction it held.
    Record(
        "ucm_cache_hit_rate",
        f"{_rate('ucm_store_lookup_hits_total', _STORE_BY)} / {_rate('ucm_store_lookup_blocks_total', _STORE_BY)}",
    ),
    # Of the prompt tokens engines processed, the fraction loaded from the store instead of computed.
    Record(
        "ucm_kv_cache_hit_rate",
        f"{_rate('ucm_connector_external_hit_tokens_total')} / {_rate('vllm:prompt_tokens_total')}",
    ),
    Record("ucm_io_throughput_gbps", f"{_rate('ucm_store_bytes_total', f'{_STORE_BY}, op')} / 1e9"),
    *(
        Record(
            f"ucm_{op}_latency_seconds",
            _quantile(q, f'ucm_store_operation_seconds_bucket{{op="{op}"}}', _STORE_BY),
            {"quantile": q},
        )
        for op in ("load", "dump")
        for q in ("0.5", "0.99")
    ),
    # Of the KV blocks sparse decoding could have read, the fraction it attended.
    Record(
        "ucm_sparse_ratio",
        f"{_rate('ucm_sparse_blocks_attended_total', f'{BY}, algorithm')}"
        f" / {_rate('ucm_sparse_blocks_available_total', f'{BY}, algorithm')}",
    ),
    Record(
        "ucm_memory_usage_bytes",
        f"max by ({_STORE_BY}) (ucm_store_used_bytes)",
        {"location": "external"},
    ),
    Record("ucm_store_capacity_ratio", f"max by ({_STORE_BY}) (ucm_store_used_bytes / ucm_store_capacity_bytes)"),
    # Of the requests the proxy sent on the PD path, the fraction that ran on decode alone.
    Record("ucm_pd_fallback_ratio", _share('path="fallback"', 'path=~"pd|fallback"')),
    Record("ucm_proxy_error_ratio", _share('status=~"5.."', "")),
]

ALERTS = [
    Alert(
        "UCMPDPathBroken",
        f"min by ({BY}) (ucm_proxy_pd_path_healthy) == 0",
        "2m",
        "critical",
        "Prefill -> store -> decode is broken for {{ $labels.ucm_deployment }}",
        "The proxy's PD path check fails; requests fall back to decode alone (slower, still correct). "
        "The deployment's PDPathHealthy condition names the broken hop.",
    ),
    Alert(
        "UCMPDFallbackHigh",
        "ucm_pd_fallback_ratio > 0.1",
        "10m",
        "warning",
        "{{ $value | humanizePercentage }} of PD requests of {{ $labels.ucm_deployment }} ran on decode alone",
        "Prefill was unavailable or unpaired for these requests; see ucm_proxy_requests_total{path} and /pd-path.",
    ),
    Alert(
        "UCMStoreDegraded",
        f"max by ({BY}, backend) (ucm_proxy_backend_store_degraded) == 1",
        "2m",
        "warning",
        "Engine {{ $labels.backend }} of {{ $labels.ucm_deployment }} says its KV store does not answer",
        "Its /health carries X-UCM-Store: degraded: it serves on without the store (prompts are recomputed, "
        "nothing is saved) and the proxy sends PD requests around it, or to decode alone. Look at the store's "
        "server or mount (NFS, 3FS, Mooncake) from that engine's pod.",
    ),
    Alert(
        "UCMStoreErrors",
        _rate('ucm_store_blocks_total{result!="ok"}', f"{_STORE_BY}, op") + " > 0",
        "10m",
        "warning",
        "The {{ $labels.backend }} store of {{ $labels.ucm_deployment }} fails {{ $labels.op }}s",
        "Blocks that fail to load are recomputed and blocks that fail to save are lost: correct but slower. "
        "Look for a full, unmounted or unreachable store in the engines' logs.",
    ),
    Alert(
        "UCMStoreCorruptBlocks",
        f"sum by ({_STORE_BY}) (increase(ucm_store_corrupt_blocks_total[15m])) > 0",
        "0m",
        "warning",
        "Blocks of the {{ $labels.backend }} store of {{ $labels.ucm_deployment }} failed their integrity check",
        "They were treated as misses and recomputed. Run `ucm store verify --repair`; a rising count points "
        "at the volume, or, with store.mac, at someone writing blocks without the key.",
    ),
    Alert(
        "UCMCacheHitRateCollapse",
        "ucm_cache_hit_rate < 0.5 * (ucm_cache_hit_rate offset 1h) and (ucm_cache_hit_rate offset 1h) > 0.2",
        "15m",
        "warning",
        "The store hit rate of {{ $labels.ucm_deployment }} fell to under half of an hour ago",
        "A changed salt, model, block size or hashing (a new pairing identity) starts a cold store, as does "
        "eviction of a too-small store (see ucm_store_capacity_ratio).",
    ),
    Alert(
        "UCMProxyErrors",
        "ucm_proxy_error_ratio > 0.05",
        "5m",
        "critical",
        "{{ $value | humanizePercentage }} of requests to the proxy of {{ $labels.ucm_deployment }} fail (5xx)",
        "No healthy backend, or backends failing; see ucm_proxy_backend_healthy and the engines' logs.",
    ),
    Alert(
        "UCMEngineQueueGrowing",
        f"sum by ({BY}, ucm_role) (vllm:num_requests_waiting) > 4"
        f" and deriv(sum by ({BY}, ucm_role) (vllm:num_requests_waiting)[10m:1m]) > 0",
        "15m",
        "warning",
        "Requests queue up on the {{ $labels.ucm_role }} engines of {{ $labels.ucm_deployment }}",
        "The pool is short of capacity: raise its replicas or its autoscaling maximum.",
    ),
    Alert(
        "UCMStoreNearCapacity",
        "ucm_store_capacity_ratio > 0.97",
        "15m",
        "warning",
        "The {{ $labels.backend }} store of {{ $labels.ucm_deployment }} stays near its capacity",
        "Eviction keeps it under the high watermark; staying above means eviction cannot keep up or cannot "
        "remove blocks (see the engines' logs).",
    ),
]


def rule_groups() -> dict[str, Any]:
    """The rules file (Prometheus' format; a PrometheusRule's ``spec`` is the same)."""
    return {
        "groups": [
            {"name": "ucm.records", "rules": [r.rule() for r in RECORDS]},
            {"name": "ucm.alerts", "rules": [a.rule() for a in ALERTS]},
        ]
    }


def render() -> str:
    header = "# Generated by `python -m ucm.deploy.rules` from ucm/deploy/rules.py. Do not edit.\n"
    return header + yaml.safe_dump(rule_groups(), sort_keys=False, width=120)


def main() -> int:
    Path(sys.argv[1]).write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
