"""``ucm-operator``: run the operator (Kopf underneath) with a liveness endpoint."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

import kopf
import prometheus_client

from ucm.deploy import policy
from ucm_operator.handlers import new_memo, registry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ucm-operator", description="Reconcile UCMDeployment resources")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", help="watch only this namespace (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL ('' disables)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve ucm_operator_* metrics here (0: off)")
    p.add_argument("--server", help="API server URL without credentials (development); default: in-cluster/kubeconfig")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="less severe log records are dropped (the operator's and Kopf's)",
    )
    policy.add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_port:
        prometheus_client.start_http_server(args.metrics_port)
    try:
        asyncio.run(
            kopf.operator(
                registry=registry,
                memo=new_memo(server=args.server, policy=policy.from_args(args)),
                standalone=True,  # one replica (the chart's Recreate strategy): no peering objects to manage
                clusterwide=not args.namespace,
                namespaces=args.namespace or (),
                liveness_endpoint=args.liveness or None,
            )
        )
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
