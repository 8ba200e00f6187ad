"""The Grafana dashboard of UCM deployments, as code (``grafana-foundation-sdk``).

One dashboard for every deployment, chosen with its ``namespace`` and ``deployment`` variables;
it reads the series the chart's monitors (or ``ucm up --monitor``) scrape and the rules of
``ucm.deploy.rules`` record. ``python -m ucm.deploy.dashboard FILE`` writes its JSON, which the
chart ships in a ConfigMap labelled for Grafana's dashboard sidecar. The SDK is needed only to
regenerate the file (a development dependency); the JSON is checked in.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

UID = "ucm-deployments"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'namespace=~"$namespace", ucm_deployment=~"$deployment"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat": one current value


def _quantiles(bucket: str, by: str) -> tuple[Query, ...]:
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({by}, le) (rate({bucket}{{{SEL}}}[{RATE}])))",
            f"p{round(float(q) * 100)} {{{{{by}}}}}",
        )
        for q in ("0.5", "0.99")
    )


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Requests through the proxy",
        [
            Panel(
                "Requests by path",
                "pd: prefill then decode; direct: decode alone, the prompt short or its prefix stored; "
                "fallback: decode alone, prefill unavailable; decode_only: a mixed pool",
                (Query(f"sum by (path) (rate(ucm_proxy_requests_total{{{SEL}}}[{RATE}]))", "{{path}}"),),
                "reqps",
            ),
            Panel(
                "Request latency",
                "Whole requests as clients see them, by route",
                _quantiles("ucm_proxy_request_seconds_bucket", "route"),
                "s",
            ),
            Panel(
                "PD path healthy",
                "1: the proxy's last check through prefill, store and decode passed (decode loaded the KV)",
                (Query(f"min(ucm_proxy_pd_path_healthy{{{SEL}}})", "healthy"),),
                kind="stat",
            ),
            Panel(
                "KV-aware routing",
                "Prompt tokens the prefill engine chosen held cached, as the proxy's KV index predicted, against "
                "the prefix cache hits the prefill engines counted; and decisions without an index or a hit",
                (
                    Query(f"sum(rate(ucm_proxy_kv_predicted_hit_tokens_total{{{SEL}}}[{RATE}]))", "predicted"),
                    Query(f'sum(rate(vllm:prefix_cache_hits_total{{{SEL}, ucm_role="prefill"}}[{RATE}]))', "engines"),
                    Query(
                        f'sum by (reason) (rate(ucm_proxy_kv_routing_total{{{SEL}, reason!="hit"}}[{RATE}]))',
                        "{{reason}} (req/s)",
                    ),
                ),
            ),
            Panel(
                "Fallback and error ratios",
                "Of PD requests, those served by decode alone; of all requests, those answered 5xx",
                (
                    Query(f"ucm_pd_fallback_ratio{{{SEL}}}", "fallback"),
                    Query(f"ucm_proxy_error_ratio{{{SEL}}}", "5xx"),
                ),
                "percentunit",
            ),
        ],
    ),
    (
        "Engines",
        [
            Panel(
                "Time to first token",
                "vLLM's TTFT per pool (a PD request's first token comes from decode)",
                _quantiles("vllm:time_to_first_token_seconds_bucket", "ucm_role"),
                "s",
            ),
            Panel(
                "Inter-token latency",
                "vLLM's time between output tokens per pool",
                _quantiles("vllm:inter_token_latency_seconds_bucket", "ucm_role"),
                "s",
            ),
            Panel(
                "Queued and running requests",
                "Waiting requests growing means the pool is short of capacity",
                (
                    Query(f"sum by (ucm_role) (vllm:num_requests_waiting{{{SEL}}})", "waiting {{ucm_role}}"),
                    Query(f"sum by (ucm_role) (vllm:num_requests_running{{{SEL}}})", "running {{ucm_role}}"),
                ),
            ),
            Panel(
                "GPU KV cache usage",
                "The fullest engine of each pool",
                (Query(f"max by (ucm_role) (vllm:kv_cache_usage_perc{{{SEL}}})", "{{ucm_role}}"),),
                "percentunit",
            ),
            Panel(
                "Engines per pool",
                "Engines Prometheus scrapes, by pool",
                (Query(f'count by (ucm_role) (up{{{SEL}, ucm_role=~"prefill|decode"}} == 1)', "{{ucm_role}}"),),
                kind="stat",
            ),
        ],
    ),
    (
        "KV store",
        [
            Panel(
                "Hit rates",
                "block: of block ids looked up, those the store held; tokens: of prompt tokens, those loaded",
                (
                    Query(f"ucm_cache_hit_rate{{{SEL}}}", "block {{backend}}"),
                    Query(f"ucm_kv_cache_hit_rate{{{SEL}}}", "tokens"),
                ),
                "percentunit",
            ),
            Panel(
                "Store I/O (GB/s)",
                "Bytes loaded into and saved from engines, per store stage",
                (Query(f"ucm_io_throughput_gbps{{{SEL}}}", "{{op}} {{backend}}"),),
            ),
            Panel(
                "Load and dump latency",
                "One batched store operation, submission to completion",
                (
                    Query(f"ucm_load_latency_seconds{{{SEL}}}", "load p{{quantile}} {{backend}}"),
                    Query(f"ucm_dump_latency_seconds{{{SEL}}}", "dump p{{quantile}} {{backend}}"),
                ),
                "s",
            ),
            Panel(
                "Store capacity",
                "Bytes in the store at the last capacity check, and the capacity eviction keeps it under",
                (
                    Query(f"ucm_memory_usage_bytes{{{SEL}}}", "used {{backend}}"),
                    Query(f"max by (backend) (ucm_store_capacity_bytes{{{SEL}}})", "capacity {{backend}}"),
                ),
                "bytes",
            ),
            Panel(
                "Sparse attention: KV read",
                "Of the KV blocks sparse decoding could read, the fraction it attended (1: dense)",
                (Query(f"ucm_sparse_ratio{{{SEL}}}", "{{algorithm}}"),),
                "percentunit",
            ),
        ],
    ),
]


def _panel(p: Panel) -> Any:
    builder = (stat.Panel() if p.kind == "stat" else timeseries.Panel()).title(p.title).description(p.description)
    builder = builder.unit(p.unit).datasource(DATASOURCE).height(8).span(12 if p.kind == "timeseries" else 6)
    for i, q in enumerate(p.queries):
        builder = builder.with_target(
            prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
        )
    return builder


def _variable(name: str, label: str, query: str) -> gd.QueryVariable:
    return (
        gd.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .include_all(True)
        .all_value(".*")
        .multi(True)
    )


def dashboard() -> dict[str, Any]:
    board = (
        gd.Dashboard("UCM deployments")
        .uid(UID)
        .tags(["ucm", "vllm"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(_variable("namespace", "Namespace", "label_values(ucm_proxy_requests_total, namespace)"))
        .with_variable(
            _variable(
                "deployment",
                "Deployment",
                'label_values(ucm_proxy_requests_total{namespace=~"$namespace"}, ucm_deployment)',
            )
        )
    )
    for title, panels in ROWS:
        board = board.with_row(gd.Row(title))
        for p in panels:
            board = board.with_panel(_panel(p))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    Path(sys.argv[1]).write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
