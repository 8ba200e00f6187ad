"""What a ``UCMDeployment`` may ask the operator for.

The operator's service account creates whatever a resource renders into, so whoever may create a
``UCMDeployment`` would otherwise choose any image, mount any node directory and schedule onto any
node. The platform team that installs the operator bounds that (chart values ``policy.*``, the
operator's ``--allow-*`` flags); a spec outside the bounds is ``Degraded/InvalidSpec`` naming the
field, and nothing is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import posixpath
from dataclasses import dataclass
from typing import Any

from ucm.deploy import autoscaling, monitors
from ucm.deploy.autoscaling import Autoscaler
from ucm.deploy.monitors import Monitors
from ucm.deploy.roles import fail
from ucm.deploy.spec import PoolSpec, UCMDeploymentSpec

# vLLM flags a spec may not pass: they load code into the engine (remote code, middleware, parser
# plugins) or undo what the deployment decides (its key, address, connector).
REFUSED_FLAGS = {
    "--trust-remote-code": "runs code downloaded with the model",
    "--middleware": "loads code into the API server",
    "--tool-parser-plugin": "loads code into the API server",
    "--reasoning-parser-plugin": "loads code into the API server",
    "--allowed-local-media-path": "lets requests read files of the pod",
    "--api-key": "the deployment sets the engines' key",
    "--kv-transfer-config": "the deployment sets the connector",
    "--host": "the deployment sets the address",
    "--port": "the deployment sets the port",
}
CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


@dataclass(frozen=True)
class Policy:
    # Image name prefixes a spec may use ("ucm/" allows ucm/runtime and ucm/proxy, the defaults).
    image_prefixes: tuple[str, ...] = ("ucm/",)
    # Node directories a spec may mount (model.source.hostPath, store.ds3fs.mountPath): none.
    host_path_prefixes: tuple[str, ...] = ()
    # Tolerations and node selection toward control-plane nodes, and match-everything tolerations.
    any_scheduling: bool = False
    # Not a bound but the cluster's fact the spec is checked against too: what scales a pool.
    autoscaler: Autoscaler = dataclasses.field(default_factory=Autoscaler)
    # Another cluster fact: whether Prometheus Operator monitors are rendered, labelled how.
    monitors: Monitors = dataclasses.field(default_factory=Monitors)

    def check(self, spec: UCMDeploymentSpec) -> None:
        """Raises :class:`PlanError` naming the first field outside the bounds."""
        images = [("image.repository", spec.image.repository), ("proxy.image", spec.proxy.image)]
        if spec.store.type == "mooncake" and spec.store.mooncake.master is not None:  # type: ignore[attr-defined]
            images.append(("store.mooncake.master.image", spec.store.mooncake.master.image))  # type: ignore[attr-defined]
        for field, image in images:
            if image is not None and not image.startswith(self.image_prefixes):
                raise fail(field, f"{image} is not from an allowed repository ({', '.join(self.image_prefixes)})")
        paths = [("model.source.hostPath", spec.model.source.host_path)]
        if spec.store.type == "ds3fs":
            paths.append(("store.ds3fs.mountPath", spec.store.ds3fs.mount_path))  # type: ignore[attr-defined]
        for field, path in paths:
            if path is not None:
                self._host_path(field, path)
        _refused_flags("model.extraArgs", spec.model.extra_args)
        for name, pool in (("prefill", spec.prefill), ("decode", spec.decode)):
            _refused_flags(f"{name}.extraArgs", pool.extra_args)
            if not self.any_scheduling:
                _scheduling(name, pool)
        self.autoscaler.check(spec)

    def _host_path(self, field: str, path: str) -> None:
        normal = posixpath.normpath(path)
        allowed = any(
            normal == p.rstrip("/") or normal.startswith(p.rstrip("/") + "/") for p in self.host_path_prefixes
        )
        if not path.startswith("/") or not allowed:
            listed = ", ".join(self.host_path_prefixes) or "none: the operator allows no node directories"
            raise fail(field, f"{path} is not under an allowed host path ({listed})")


def _refused_flags(field: str, args: list[str]) -> None:
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in REFUSED_FLAGS:
            raise fail(f"{field}[{i}]", f"{flag} is not allowed: {REFUSED_FLAGS[flag]}")


def _scheduling(pool_name: str, pool: PoolSpec) -> None:
    for key in pool.node_selector:
        if key in CONTROL_PLANE_LABELS:
            raise fail(f"{pool_name}.nodeSelector.{key}", "engines may not be placed on control-plane nodes")
    for i, t in enumerate(pool.tolerations):
        key = t.get("key")
        if not key:
            raise fail(f"{pool_name}.tolerations[{i}]", "a toleration needs a key (one without tolerates every taint)")
        if key in CONTROL_PLANE_LABELS:
            raise fail(f"{pool_name}.tolerations[{i}].key", "engines may not tolerate control-plane taints")
    if pool.affinity and _mentions(pool.affinity, CONTROL_PLANE_LABELS):
        raise fail(f"{pool_name}.affinity", "engines may not be placed on control-plane nodes")


def _mentions(value: Any, words: tuple[str, ...]) -> bool:
    if isinstance(value, dict):
        return any(_mentions(v, words) for v in value.values())
    if isinstance(value, list):
        return any(_mentions(v, words) for v in value)
    return isinstance(value, str) and value in words


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bounds as flags: the operator's (set from the chart's ``policy.*``) and ``ucm render``'s,
    which checks a resource against the same bounds before anyone applies it."""
    bounds = p.add_argument_group("what a UCMDeployment may ask for (ucm.deploy.policy)")
    bounds.add_argument(
        "--allow-image-prefix", action="append", help="an image name prefix specs may use (repeatable; default: ucm/)"
    )
    bounds.add_argument(
        "--allow-host-path",
        action="append",
        default=[],
        help="a node directory specs may mount (repeatable; none by default)",
    )
    bounds.add_argument(
        "--allow-any-scheduling", action="store_true", help="pass control-plane placement and keyless tolerations"
    )
    autoscaling.add_arguments(p)
    monitors.add_arguments(p)


def from_args(args: argparse.Namespace) -> Policy:
    return Policy(
        image_prefixes=tuple(args.allow_image_prefix or Policy.image_prefixes),
        host_path_prefixes=tuple(args.allow_host_path),
        any_scheduling=args.allow_any_scheduling,
        autoscaler=autoscaling.from_args(args),
        monitors=monitors.from_args(args),
    )
