"""The shipped Prometheus rules and Grafana dashboard: generated, checked by Prometheus' own
promtool (syntax, and the alerts' behaviour on synthetic series), and what the chart installs.
That every query returns data from a real stack: e2e/test_monitor.py."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.operator.conftest import CHART, helm, run_helm
from ucm.deploy import dashboard, rules

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "charts" / "ucm-operator" / "files"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool: Debian's prometheus (make dev installs it)")


def test_checked_in_rules_and_dashboard_are_what_the_code_generates():
    assert (FILES / "ucm-rules.yaml").read_text() == rules.render(), "run: make generate"
    assert (FILES / "ucm-dashboard.json").read_text() == dashboard.render(), "run: make generate"


@needs_promtool
def test_promtool_accepts_the_rules():
    r = subprocess.run([PROMTOOL, "check", "rules", str(FILES / "ucm-rules.yaml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules.RECORDS) + len(rules.ALERTS)} rules found" in r.stdout


SERIES = {
    "prefill": 'ucm_deployment="d", ucm_role="prefill", instance="p:1", backend="posix"',
    "proxy": 'ucm_deployment="d", ucm_role="proxy", instance="x:1"',
}


def firing(name: str, eval_time: str, labels: dict[str, str], summary: str) -> dict:
    """A promtool expectation: alert ``name`` fires at ``eval_time`` with these labels and summary,
    and the description the rules give it."""
    description = next(a for a in rules.ALERTS if a.name == name).description
    return {
        "eval_time": eval_time,
        "alertname": name,
        "exp_alerts": [{"exp_labels": labels, "exp_annotations": {"summary": summary, "description": description}}],
    }


# promtool's unit tests: one-minute samples, then what the rules must record and which alerts fire.
UNIT_TESTS = {
    "rule_files": [str(FILES / "ucm-rules.yaml")],
    "evaluation_interval": "1m",
    "tests": [
        {
            "interval": "1m",
            "input_series": [
                {"series": f"ucm_store_lookup_blocks_total{{{SERIES['prefill']}}}", "values": "0+60x30"},
                {"series": f"ucm_store_lookup_hits_total{{{SERIES['prefill']}}}", "values": "0+45x30"},
                {"series": f"ucm_store_used_bytes{{{SERIES['prefill']}}}", "values": "990x30"},
                {"series": f"ucm_store_capacity_bytes{{{SERIES['prefill']}}}", "values": "1000x30"},
                {"series": f"ucm_proxy_pd_path_healthy{{{SERIES['proxy']}}}", "values": "1 1 1 0x27"},
                {
                    "series": f'ucm_proxy_backend_store_degraded{{{SERIES["proxy"]}, backend="http://p:8000", '
                    'role="prefill"}',
                    "values": "0x9 1x20",
                },
                {
                    "series": f'ucm_proxy_requests_total{{{SERIES["proxy"]}, route="/v1/completions", status="200", '
                    'path="pd"}',
                    "values": "0+60x30",
                },
                {
                    "series": f'ucm_proxy_requests_total{{{SERIES["proxy"]}, route="/v1/completions", status="200", '
                    'path="fallback"}',
                    "values": "0+20x30",
                },
            ],
            "promql_expr_test": [
                {
                    "expr": "ucm_cache_hit_rate",
                    "eval_time": "10m",
                    "exp_samples": [
                        {"labels": 'ucm_cache_hit_rate{ucm_deployment="d", backend="posix"}', "value": 0.75}
                    ],
                },
                {
                    "expr": "ucm_pd_fallback_ratio",
                    "eval_time": "10m",
                    "exp_samples": [{"labels": 'ucm_pd_fallback_ratio{ucm_deployment="d"}', "value": 0.25}],
                },
                {
                    "expr": "ucm_proxy_error_ratio",  # 0 while no request failed, not "no data"
                    "eval_time": "10m",
                    "exp_samples": [{"labels": 'ucm_proxy_error_ratio{ucm_deployment="d"}', "value": 0}],
                },
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "UCMPDPathBroken", "exp_alerts": []},  # not for 2m yet
                firing(
                    "UCMPDPathBroken",
                    "6m",
                    {"severity": "critical", "ucm_deployment": "d"},
                    "Prefill -> store -> decode is broken for d",
                ),
                {"eval_time": "12m", "alertname": "UCMStoreNearCapacity", "exp_alerts": []},
                firing(
                    "UCMStoreNearCapacity",
                    "20m",
                    {"severity": "warning", "ucm_deployment": "d", "backend": "posix"},
                    "The posix store of d stays near its capacity",
                ),
                firing(
                    "UCMPDFallbackHigh",
                    "20m",
                    {"severity": "warning", "ucm_deployment": "d"},
                    "25% of PD requests of d ran on decode alone",
                ),
                {"eval_time": "20m", "alertname": "UCMProxyErrors", "exp_alerts": []},
                {"eval_time": "10m", "alertname": "UCMStoreDegraded", "exp_alerts": []},  # not for 2m yet
                firing(
                    "UCMStoreDegraded",
                    "13m",
                    {"severity": "warning", "ucm_deployment": "d", "backend": "http://p:8000"},
                    "Engine http://p:8000 of d says its KV store does not answer",
                ),
            ],
        }
    ],
}


@needs_promtool
def test_the_rules_record_and_alert_as_documented(tmp_path):
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump(UNIT_TESTS, sort_keys=False))
    r = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def template(tmp_path: Path, *args: str) -> str:
    """The chart as `helm template` renders it with ``args``."""
    return helm("template", "u", str(CHART), *args, tmp=tmp_path)


def test_the_chart_ships_the_rules_and_the_dashboard(tmp_path):
    sets = ["monitoring.prometheusOperator=true", "monitoring.grafanaDashboard.enabled=true"]
    sets.append("monitoring.grafanaDashboard.namespace=grafana")
    out = template(tmp_path, *(x for s in sets for x in ("--set", s)))
    docs = {d["kind"]: d for d in yaml.safe_load_all(out) if d}
    assert docs["PrometheusRule"]["spec"] == rules.rule_groups()
    config_map = docs["ConfigMap"]
    assert config_map["metadata"]["namespace"] == "grafana"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["ucm-deployments.json"]) == dashboard.dashboard()
    off = template(tmp_path)
    assert "PrometheusRule" not in off and "ucm-deployments.json" not in off


def test_each_alert_links_its_runbook_where_the_docs_are_hosted(tmp_path):
    on = ("--set", "monitoring.prometheusOperator=true")
    out = template(tmp_path, *on, "--set", "monitoring.runbookBaseUrl=https://docs.example.com/ucm/")
    rule = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule")
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]
    runbooks = (ROOT / "docs" / "operations" / "troubleshooting.md").read_text()
    for alert in alerts:
        page, anchor = alert["annotations"]["runbook_url"].split("#")
        assert page == "https://docs.example.com/ucm/operations/troubleshooting.html"
        assert anchor == alert["alert"].lower()
        assert f"\n### {alert['alert']}\n" in runbooks  # mkdocs gives that heading this anchor
    assert {a["alert"] for a in alerts} == {a.name for a in rules.ALERTS}
    bad = run_helm("template", "u", str(CHART), *on, "--set", "monitoring.runbookBaseUrl=docs", tmp=tmp_path)
    assert bad.returncode != 0 and "runbookBaseUrl" in bad.stderr


def test_a_dashboard_without_labels_is_refused_by_the_values_schema(tmp_path):
    """Without a label Grafana's sidecar never finds the ConfigMap (and the template broke on {})."""
    values = tmp_path / "values.yaml"
    # null removes the chart's default label (an empty map would merge with it)
    values.write_text("monitoring: {grafanaDashboard: {enabled: true, labels: null}}\n")
    r = run_helm("template", "u", str(CHART), "-f", str(values), tmp=tmp_path)
    assert r.returncode != 0 and "monitoring.grafanaDashboard.labels: give at least one label" in r.stderr, r.stderr
    assert "YAML parse error" not in r.stderr


@pytest.mark.parametrize("served", [True, False], ids=["crds-installed", "no-crds"])
def test_auto_follows_whether_the_cluster_serves_the_prometheus_operator(served, tmp_path):
    args = ["--set", "monitoring.prometheusOperator=auto"]
    if served:
        args += ["--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]
    docs = [d for d in yaml.safe_load_all(template(tmp_path, *args)) if d]
    operator_args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert ("--prometheus-operator" in operator_args) is served
    assert any(d["kind"] == "PrometheusRule" for d in docs) is served
