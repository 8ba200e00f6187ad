"""``ucm up --monitor``: a real Prometheus (Debian's ``prometheus``) scraping the local stack with
the rules the chart ships (``ucm.deploy.rules``).

Its targets are a file (``file_sd``) that the stack rewrites whenever its engines change (a
``ucm restart`` moves them to new ports); each target carries the labels the chart's monitors set
in a cluster, ``ucm_deployment`` and ``ucm_role``, so the same rules and dashboard queries work
on both.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from ucm.deploy import rules
from ucm.deploy.roles import Port, Probe, Role

NAME = "prometheus"
CONFIG_FILE = "prometheus.yml"
RULES_FILE = "ucm-rules.yaml"
TARGETS_FILE = "prometheus-targets.json"
# Often enough that a short local run has several samples per rate window.
INTERVAL = "5s"


def role(run_dir: Path, port: int) -> Role:
    return Role(
        name=NAME,
        component=NAME,  # type: ignore[arg-type]  # not a deployment's component: ucm up runs it beside them
        command=[
            "prometheus",
            f"--config.file={run_dir / CONFIG_FILE}",
            f"--storage.tsdb.path={run_dir / NAME}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=2d",
        ],
        ports=[Port("http", port)],
        readiness=Probe("http", "/-/ready"),
    )


def write_config(run_dir: Path, proxy_token: Path | None = None) -> None:
    """``proxy_token``: the file of the bearer token the proxy's /metrics requires (proxy.metricsAuth);
    sent to every target (the engines' /metrics ignore it)."""
    (run_dir / RULES_FILE).write_text(rules.render())
    job: dict[str, Any] = {
        "job_name": "ucm",
        "file_sd_configs": [{"files": [str(run_dir / TARGETS_FILE)], "refresh_interval": INTERVAL}],
    }
    if proxy_token is not None:
        job["authorization"] = {"type": "Bearer", "credentials_file": str(proxy_token)}
    config = {
        "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL},
        "rule_files": [str(run_dir / RULES_FILE)],
        "scrape_configs": [job],
    }
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))


def targets(deployment: str, endpoints: Iterable[tuple[str, int]]) -> list[dict[str, Any]]:
    """The ``file_sd`` targets of (component, port) pairs, each a process serving ``/metrics``."""
    return [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"ucm_deployment": deployment, "ucm_role": component}}
        for component, port in endpoints
    ]
