"""``ucm render -f CR.yaml``: the exact objects the operator would create for a ``UCMDeployment``, as
a YAML stream (like ``helm template``), for review in GitOps and for ``kubectl diff``.

The same validation as the operator: the spec's schema, the operator's bounds (the same
``--allow-*`` flags as ``ucm-operator``: give the values your chart's ``policy.*`` sets), the
plan's ``PlanError``s, and the proxy's own check of its configuration. Children carry an owner
reference only when the resource's uid is known (``--owner-uid``, or ``metadata.uid`` of a resource
read back from the API server): the operator sets it to the live resource's uid, which does not
exist before it is created.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ucm.config import ConfigError
from ucm.deploy import policy
from ucm.deploy.kubernetes import Owner, render
from ucm.deploy.local import StackError, check_proxy_config
from ucm.deploy.plan import PROXY_CONFIG_FILE, build_plan
from ucm.deploy.resource import load_resource
from ucm.deploy.roles import PlanError, Site


def add_parser(sub: Any) -> None:
    p = sub.add_parser("render", help="print the Kubernetes objects the operator creates for a UCMDeployment")
    p.add_argument("-f", "--file", required=True, help="a UCMDeployment (YAML; '-' reads standard input)")
    p.add_argument("-n", "--namespace", help="default: the resource's metadata.namespace, else 'default'")
    p.add_argument("--name", help="default: the resource's metadata.name")
    p.add_argument("--owner-uid", help="the UCMDeployment's uid, for owner references (default: metadata.uid)")
    policy.add_arguments(p)
    p.set_defaults(func=cmd_render)


def objects(
    path: str, namespace: str | None, name: str | None, uid: str | None, bounds: policy.Policy | None = None
) -> list[dict[str, Any]]:
    resource = load_resource(path)
    name = name or resource.name
    if not name:
        raise ConfigError("--name: required when the file holds no metadata.name")
    namespace = namespace or resource.namespace or "default"
    bounds = bounds or policy.Policy()
    try:
        bounds.check(resource.spec, namespace, name)
        plan = build_plan(name, resource.spec, Site("kubernetes", namespace=namespace))
    except PlanError as exc:
        raise ConfigError(f"spec.{exc}") from None
    with tempfile.TemporaryDirectory() as tmp:
        proxy_config = Path(tmp) / PROXY_CONFIG_FILE
        proxy_config.write_text(plan.files[PROXY_CONFIG_FILE])
        try:
            check_proxy_config(proxy_config)
        except StackError as exc:
            raise ConfigError(f"spec.{exc}") from None
    return render(Owner(name, namespace, uid or resource.uid), resource.spec, plan, bounds.autoscaler, bounds.monitors)


def cmd_render(args: argparse.Namespace) -> int:
    docs = objects(args.file, args.namespace, args.name, args.owner_uid, policy.from_args(args))
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False, explicit_start=True)
    return 0
