"""``ucm up --monitor``: a real Prometheus scrapes the local PD stack (sparse decode, a store with a
capacity) with the rules the chart ships. Under a short load, every recording rule and every query
of the shipped dashboard returns data, every alert evaluates without error, and promtool accepts
the rules the stack wrote."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.conftest import Stack, running
from e2e.test_sparse_stack import SPARSE_SPEC
from e2e.test_stack import post
from ucm.deploy import prometheus, rules
from ucm.deploy.local import default_spec
from ucm_testing.prompts import PROMPTS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus (make dev installs it)"),
]
DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "ucm-operator" / "files" / "ucm-dashboard.json"
NAME = "monitored"


@pytest.fixture(scope="module")
def monitored(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    spec = {**default_spec(tiny_model), "sparse": SPARSE_SPEC}
    spec["store"] = {**spec["store"], "files": {"capacity": "256Mi"}}
    spec["proxy"] = {**spec["proxy"], "metricsAuth": True}  # Prometheus scrapes the proxy with the generated token
    args = ("--monitor", "--monitor-port", "0")
    with running(Stack(tmp_path_factory.mktemp("monitored"), spec, name=NAME, args=args)) as s:
        yield s


def prometheus_url(stack: Stack) -> str:
    (line,) = [line for line in stack.lines if "Prometheus: " in line]
    return line.split("Prometheus: ", 1)[1].split()[0]


def query(url: str, expr: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def panel_queries() -> list[str]:
    """The shipped dashboard's queries, with Grafana's variables as a user picking this stack sets them."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    values = {"$namespace": ".*", "$deployment": NAME, "$__rate_interval": "1m"}
    for var, value in values.items():
        exprs = [e.replace(var, value) for e in exprs]
    return exprs


class Load:
    """Requests in a loop (long prompts, each twice: a miss, then hits) until stopped."""

    def __init__(self, base_url: str) -> None:
        self.base_url, self.sent, self.failed = base_url, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            body = {"model": "tiny", "prompt": PROMPTS[(i // 2) % len(PROMPTS)], "max_tokens": 8, "temperature": 0}
            status, _ = post(self.base_url + "/completions", body)
            self.sent, self.failed, i = self.sent + 1, self.failed + (status != 200), i + 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(180)


def test_every_rule_and_panel_has_data_from_a_running_stack(monitored: Stack):
    url = prometheus_url(monitored)
    records = sorted({r.name for r in rules.RECORDS})
    with Load(monitored.base_url) as load:
        # A rate() has data once its series has two samples in the window: a counter born at the
        # first prefix hit has none until the next scrape, so the panels are waited for as the rules are.
        deadline = time.monotonic() + 240
        panels = panel_queries()
        missing, empty = records, panels
        while (missing or empty) and time.monotonic() < deadline:
            time.sleep(5)
            missing = [name for name in records if not query(url, name)]
            empty = [expr for expr in panels if not query(url, expr)]
        assert not missing, f"recording rules without data after {load.sent} requests: {missing}"
        assert not empty, f"dashboard queries without data after {load.sent} requests: {empty}"
    assert load.failed == 0
    hit_rate = query(url, f'ucm_cache_hit_rate{{ucm_deployment="{NAME}"}}')
    assert max(float(s["value"][1]) for s in hit_rate) > 0  # repeated prompts were found in the store
    # The store's own series leave the engines' worker processes (summed on their /metrics).
    assert query(url, 'ucm_store_blocks_total{op="load", result="ok", ucm_role="decode"} > 0')
    assert query(url, 'ucm_store_blocks_total{op="dump", result="ok", ucm_role="prefill"} > 0')
    (roles,) = [query(url, 'count by (ucm_role) (up{ucm_role=~"prefill|decode|proxy"} == 1)')]
    assert {s["metric"]["ucm_role"] for s in roles} == {"prefill", "decode", "proxy"}
    # ... the proxy with its token: without it, its /metrics refuses.
    try:
        urllib.request.urlopen(monitored.base_url.removesuffix("/v1") + "/metrics", timeout=10)
        raise AssertionError("the proxy's /metrics answered without the metrics token")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401
    with urllib.request.urlopen(f"{url}/api/v1/rules", timeout=10) as r:
        groups = json.loads(r.read())["data"]["groups"]
    evaluated = {rule["name"]: rule for g in groups for rule in g["rules"]}
    assert set(evaluated) == set(records) | {a.name for a in rules.ALERTS}
    broken = {name: rule.get("lastError") for name, rule in evaluated.items() if rule["health"] != "ok"}
    assert not broken, broken
    run_dir = monitored.run_dir / NAME
    check = subprocess.run(["promtool", "check", "rules", str(run_dir / prometheus.RULES_FILE)], capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
