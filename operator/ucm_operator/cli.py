"""``ucm-operator``: run the operator (Kopf underneath) with a liveness endpoint; with
``--leader-election``, as one of several replicas of which one leads (``ucm_operator.leader``)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import kopf
import prometheus_client
from aiohttp import web

from ucm.deploy import policy
from ucm_operator.api import Api
from ucm_operator.handlers import new_memo, registry
from ucm_operator.leader import LeaderElector, LeadershipLost, Timing

logger = logging.getLogger("ucm_operator")


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
    election = p.add_argument_group("leader election (several replicas, one leads)")
    election.add_argument(
        "--leader-election", action="store_true", help="lead only while holding the Lease; wait as a standby otherwise"
    )
    election.add_argument("--lease-namespace", help="the Lease's namespace (default: $POD_NAMESPACE, else default)")
    election.add_argument("--lease-name", default="ucm-operator", help="the Lease's name (default: %(default)s)")
    election.add_argument("--identity", help="this replica's name in the Lease (default: $POD_NAME, else HOST-PID)")
    defaults = Timing()
    election.add_argument("--lease-duration", type=float, default=defaults.lease_s, help="seconds (%(default)s)")
    election.add_argument("--renew-deadline", type=float, default=defaults.renew_s, help="seconds (%(default)s)")
    election.add_argument("--retry-period", type=float, default=defaults.retry_s, help="seconds (%(default)s)")
    policy.add_arguments(p)
    return p


def connection(server: str | None) -> kopf.ConnectionInfo:
    """Credentials as the operator's login handler finds them, for the Lease's calls before Kopf runs."""
    if server is not None:
        return kopf.ConnectionInfo(server=server, insecure=True)
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise SystemExit("ucm-operator: no credentials (neither a service account nor a kubeconfig)")
    return info


@asynccontextmanager
async def standby_health(liveness: str) -> AsyncIterator[None]:
    """The liveness endpoint while this replica waits for the Lease (Kopf serves it once leading)."""
    if not liveness:
        yield
        return
    url = urlsplit(liveness)
    app = web.Application()
    app.router.add_get(url.path or "/", lambda _: web.json_response({"standby": True}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, url.hostname, url.port or 80).start()
    try:
        yield
    finally:
        await runner.cleanup()


async def run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    operate = functools.partial(
        kopf.operator,
        registry=registry,
        memo=new_memo(server=args.server, policy=policy.from_args(args)),
        standalone=True,  # no Kopf peering: one replica at a time (the chart's Recreate, or the Lease)
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness or None,
        stop_flag=stop,
    )
    if not args.leader_election:
        await operate()
        return 0
    api = Api()
    api.connect(connection(args.server))
    timing = Timing(args.lease_duration, args.renew_deadline, args.retry_period)
    namespace = args.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"
    identity = args.identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    elector = LeaderElector(api, namespace, args.lease_name, identity, timing)
    try:
        async with standby_health(args.liveness):
            await elector.acquire()
        operator, holding = asyncio.create_task(operate()), asyncio.create_task(elector.hold())
        await asyncio.wait([operator, holding], return_when=asyncio.FIRST_COMPLETED)
        if holding.done():
            stop.set()  # stopped before anyone else may lead (renew deadline < lease duration)
            await asyncio.wait([operator], timeout=timing.lease_s - timing.renew_s)
            holding.result()  # raises LeadershipLost (the process ends, whatever Kopf still does)
        holding.cancel()
        operator.result()
        await elector.release()  # a clean stop (SIGTERM): the standby takes over at its next look
        return 0
    except LeadershipLost as exc:
        logger.error("lost leadership, exiting (a restart waits as a standby): %s", exc)
        return 1
    finally:
        await api.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        Timing(args.lease_duration, args.renew_deadline, args.retry_period)
    except ValueError as exc:
        build_parser().error(str(exc))
    if args.metrics_port:
        prometheus_client.start_http_server(args.metrics_port)
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
