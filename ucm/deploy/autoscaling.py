"""What scales an autoscaled pool (``spec.<pool>.autoscaling``): a KEDA ``ScaledObject`` with a
Prometheus trigger, or an ``autoscaling/v2`` HorizontalPodAutoscaler reading a custom metrics
adapter. The operator's flags choose (``--autoscaler``, ``--prometheus-url``; chart values
``autoscaling.*``), and ``ucm render`` takes the same flags.

Either way the autoscaler owns the pool's replica count (a Deployment's pods, or a LeaderWorkerSet's
groups of pods for multi-pod engines): the workload is rendered without one, so no spec change
patches it back.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Literal

from ucm.deploy.pool import AutoscalingSpec
from ucm.deploy.roles import ENGINES, Role, fail
from ucm.deploy.spec import UCMDeploymentSpec

DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
# How long a pool that can scale to zero stays up after its last activity (KEDA's default is 300 s):
# an engine woken by one request must outlive its own loading (the startup probe allows 30 min), and
# while it loads neither trigger is active.
COOLDOWN_FROM_ZERO_S = 1800


@dataclass(frozen=True)
class Autoscaler:
    provider: Literal["keda", "hpa"] = "keda"
    prometheus_url: str = DEFAULT_PROMETHEUS  # KEDA's triggers query it

    def check(self, spec: UCMDeploymentSpec) -> None:
        """Raises PlanError naming a field this autoscaler cannot honour."""
        for name in ENGINES:
            scaling = getattr(spec, name).autoscaling
            if scaling is not None and scaling.min_replicas == 0 and self.provider == "hpa":
                raise fail(
                    f"{name}.autoscaling.minReplicas",
                    "0 (scale to zero) needs the KEDA autoscaler; this operator renders HPAs (--autoscaler hpa)",
                )

    def render(
        self, meta: dict[str, Any], target: dict[str, str], proxy: str, role: Role, scaling: AutoscalingSpec
    ) -> dict:
        """The autoscaler object for ``role``'s workload ``target`` (apiVersion, kind, name: its pods'
        names start with that name; the proxy's Deployment and Service are named ``proxy``)."""
        if self.provider == "keda":
            return _scaled_object(meta, target, proxy, role, scaling, self.prometheus_url)
        return _hpa(meta, target, proxy, role, scaling)


def autoscaling(role: Role) -> AutoscalingSpec | None:
    return role.pool.autoscaling if role.pool is not None else None


def _scaled_object(
    meta: dict[str, Any], target: dict[str, str], proxy: str, role: Role, scaling: AutoscalingSpec, prometheus: str
) -> dict[str, Any]:
    # KEDA divides the query's value by the target per replica: a sum over the pool's pods asks
    # for sum/target replicas, i.e. the target is per engine, as with the HPA.
    namespace = meta["namespace"]
    if scaling.signal == "proxy_in_flight":
        series = f'{scaling.metric}{{namespace="{namespace}",pod=~"{pods_of(proxy)}",role="{role.component}"}}'
    else:
        series = f'{scaling.metric}{{namespace="{namespace}",pod=~"{pods_of(target["name"], target["kind"])}"}}'
    query = {"serverAddress": prometheus, "query": f"sum({series})", "threshold": _number(scaling.target_value)}
    triggers = [{"type": "prometheus", "metadata": query}]
    if scaling.min_replicas == 0:
        triggers.append(_wake(namespace, proxy, role, prometheus))
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": dict(target),
            "minReplicaCount": scaling.min_replicas,
            **({"cooldownPeriod": COOLDOWN_FROM_ZERO_S} if scaling.min_replicas == 0 else {}),
            "maxReplicaCount": scaling.max_replicas,
            "triggers": triggers,
        },
    }


def pods_of(workload: str, kind: str = "Deployment") -> str:
    """A PromQL regex (anchored, as PromQL's are) for the names of ``workload``'s pods and no one
    else's: ``name-.*`` would also take the pods of a deployment named ``<name>-decode``. A
    Deployment's pods are ``<name>-<ReplicaSet hash>-<suffix>``; a LeaderWorkerSet's
    ``<name>-<group>`` (leaders) and ``<name>-<group>-<index>`` (workers)."""
    if kind == "LeaderWorkerSet":
        return f"{workload}-[0-9]+(-[0-9]+)?"
    # The second dash is optional: a ReplicaSet cuts its pods' name prefix to 58 characters, so
    # with a long name the hash and the suffix run together.
    return f"{workload}-[a-z0-9]+(-[a-z0-9]+)?"


def _wake(namespace: str, proxy: str, role: Role, prometheus: str) -> dict[str, Any]:
    """What brings a pool back from zero: at zero its engines' series (and the proxy's per-backend
    ones) are gone, and KEDA reads an empty result as 0, which never activates. The proxy counts
    the requests that found the pool empty; one in the last two minutes activates the pool, and
    the query is capped at 1 so that with a threshold of 1 this trigger asks for one engine, never
    more: the pool's own signal sizes it once its engines report."""
    unserved = (
        f'ucm_proxy_unserved_requests_total{{namespace="{namespace}",pod=~"{pods_of(proxy)}",role="{role.component}"}}'
    )
    query = f"clamp_max(sum(increase({unserved}[2m])), 1)"
    metadata = {"serverAddress": prometheus, "query": query, "threshold": "1", "activationThreshold": "0"}
    return {"type": "prometheus", "name": "wake-from-zero", "metadata": metadata}


def _hpa(
    meta: dict[str, Any], target: dict[str, str], proxy: str, role: Role, scaling: AutoscalingSpec
) -> dict[str, Any]:
    """Engine signals are per-pod metrics; the proxy's in-flight count is an object metric of the
    proxy Service, averaged over the pool."""
    goal = {"type": "AverageValue", "averageValue": _quantity(scaling.target_value)}
    metric: dict[str, Any]
    if scaling.signal == "proxy_in_flight":
        described = {"apiVersion": "v1", "kind": "Service", "name": proxy}
        selected = {"name": scaling.metric, "selector": {"matchLabels": {"role": role.component}}}
        metric = {"type": "Object", "object": {"describedObject": described, "metric": selected, "target": goal}}
    else:
        metric = {"type": "Pods", "pods": {"metric": {"name": scaling.metric}, "target": goal}}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": dict(target),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [metric],
        },
    }


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _quantity(value: float) -> str:
    """A Kubernetes quantity: whole numbers as they are, fractions in milli-units (0.8 -> 800m)."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def add_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("what scales an autoscaled pool (ucm.deploy.autoscaling)")
    group.add_argument(
        "--autoscaler",
        choices=["keda", "hpa"],
        default="keda",
        help="KEDA ScaledObjects (default; scale to zero possible) or HorizontalPodAutoscalers (a custom "
        "metrics adapter must serve the engines' series)",
    )
    group.add_argument(
        "--prometheus-url",
        default=DEFAULT_PROMETHEUS,
        help="the Prometheus that KEDA's triggers query (default: %(default)s)",
    )


def from_args(args: argparse.Namespace) -> Autoscaler:
    return Autoscaler(provider=args.autoscaler, prometheus_url=args.prometheus_url)
