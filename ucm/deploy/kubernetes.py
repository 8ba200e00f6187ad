"""A plan (``ucm.deploy.plan``) as Kubernetes objects: what the operator applies and ``ucm render``
prints.

Every object carries the standard labels, an owner reference to its ``UCMDeployment`` (the garbage
collector removes children with it), and ``ucm.io/desired-hash``: a digest of what the operator
wants it to be, which is how a reconcile tells "unchanged" apart without comparing against fields
the API server defaults or normalizes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ucm.deploy.autoscaling import Autoscaler, autoscaling
from ucm.deploy.monitors import Monitors
from ucm.deploy.roles import (
    CREDENTIALS,
    ENGINES,
    METRICS_TOKEN,
    STOP_SLACK_S,
    STORE_COMPONENTS,
    Plan,
    Probe,
    Role,
    Step,
    credentials_secret,
)
from ucm.deploy.spec import GROUP, KIND, PLURAL, VERSION, Scraper, UCMDeploymentSpec

MANAGED_BY = "ucm-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
DESIRED_HASH = "ucm.io/desired-hash"
CONFIG_HASH = "ucm.io/config-hash"
# On the credentials Secret: the keys the operator fills with random values when it creates it.
GENERATED_KEYS = "ucm.io/generated-keys"
CONFIG_DIR_VOLUME = "ucm-config"
RUNTIME_UID = 1000  # the user runtime/Dockerfile creates
PROXY_UID = 65532  # runtime/Dockerfile.proxy's user
# LeaderWorkerSet (multi-pod engines): its API group, and the labels its controller puts on pods.
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on leaders
LWS_GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"  # one value per group


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def labels(name: str, component: str | None = None) -> dict[str, str]:
    out = {LABEL_NAME: "ucm", LABEL_INSTANCE: name, LABEL_MANAGED_BY: MANAGED_BY}
    if component:
        out[LABEL_COMPONENT] = component
    return out


def selector(name: str, component: str) -> dict[str, str]:
    return {LABEL_INSTANCE: name, LABEL_COMPONENT: component}


def serving_pods(name: str, role: Role) -> dict[str, str]:
    """The labels of ``role``'s pods that serve: all of them, or a multi-pod engine's leaders (its
    workers hold ranks only)."""
    out = selector(name, role.component)
    if role.group is not None:
        out[LWS_WORKER_INDEX] = "0"
    return out


class Owner:
    """The ``UCMDeployment`` the children belong to. Without a uid (a resource not yet created,
    rendered by ``ucm render``) children carry no owner reference."""

    def __init__(self, name: str, namespace: str, uid: str | None) -> None:
        self.name, self.namespace, self.uid = name, namespace, uid

    def meta(self, suffix: str, component: str | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": f"{self.name}-{suffix}",
            "namespace": self.namespace,
            "labels": labels(self.name, component),
        }
        if self.uid:
            meta["ownerReferences"] = [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": KIND,
                    "name": self.name,
                    "uid": self.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        return meta


def render(
    owner: Owner,
    spec: UCMDeploymentSpec,
    plan: Plan,
    autoscaler: Autoscaler | None = None,
    monitors: Monitors | None = None,
) -> list[dict[str, Any]]:
    """Every child object, each stamped with its desired hash. ``autoscaler``: what scales an
    autoscaled pool (default: KEDA, as the operator's default); ``monitors``: whether Prometheus
    Operator monitors are rendered (default: not)."""
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": owner.meta("config", None), "data": dict(plan.files)}
    ]
    if plan.credentials:  # before the pods that read it: they would wait for it otherwise
        meta = owner.meta(CREDENTIALS, None)
        meta["annotations"] = {GENERATED_KEYS: ",".join(plan.credentials)}
        objects.append({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque"})
    if plan.store_claim is not None:
        meta = owner.meta("kv", "store")
        if plan.store_claim_retained:  # no cascade may delete it: found again by its name and labels
            meta.pop("ownerReferences", None)
        objects.append(
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": plan.store_claim}
        )
    for role in plan.roles:
        pods = _leader_worker_set if role.group is not None else _deployment
        objects.append(pods(owner, spec, plan, role))
        objects.append(_service(owner, spec, role))
        if role.component in ENGINES:
            objects.append(_pdb(owner, role))
        if (scaling := autoscaling(role)) is not None:
            meta = owner.meta(role.name, role.component)
            proxy = f"{owner.name}-proxy"
            objects.append((autoscaler or Autoscaler()).render(meta, workload(owner, role), proxy, role, scaling))
    objects += _proxy_rbac(owner)
    objects += _network_policies(owner, spec, plan)
    engines = sorted({r.component for r in plan.roles if r.component in ENGINES})
    engine_pods = {
        "matchLabels": {LABEL_INSTANCE: owner.name},
        "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": engines}],
    }
    proxy = {"matchLabels": selector(owner.name, "proxy")}
    token = None
    if METRICS_TOKEN in plan.credentials:
        token = {"name": credentials_secret(owner.name), "key": METRICS_TOKEN}
    objects += (monitors or Monitors()).render(owner.meta, engine_pods, proxy, token)
    for obj in objects:
        obj["metadata"].setdefault("annotations", {})[DESIRED_HASH] = digest(obj)
    return objects


def _probe(p: Probe | None) -> dict[str, Any] | None:
    if p is None:
        return None
    action: dict[str, Any] = (
        {"httpGet": {"path": p.path, "port": p.port}} if p.path else {"tcpSocket": {"port": p.port}}
    )
    return {
        **action,
        "initialDelaySeconds": p.initial_delay_s,
        "periodSeconds": p.period_s,
        "failureThreshold": p.failure_threshold,
    }


# The proxy's own default: its memory per request is bounded (max_body_bytes, max_in_flight), so a
# limit protects the node without starving it; CPU is left unlimited (throttling adds latency).
PROXY_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def _resources(role: Role) -> dict[str, Any]:
    if role.component == "proxy":
        return {k: dict(v) for k, v in PROXY_RESOURCES.items()}
    if role.pool is None:
        return {}
    r = role.pool.resources
    requests = {k: str(v) for k, v in r.requests.items()}
    limits = {k: str(v) for k, v in r.limits.items()}
    if r.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(r.gpus)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _template(
    owner: Owner, spec: UCMDeploymentSpec, plan: Plan, role: Role, command: list[str], serves: bool = True
) -> dict[str, Any]:
    """The pod template of ``role`` running ``command``; a pod that does not ``serve`` (a worker of a
    multi-node engine: ranks only) has no ports or probes."""
    mounts = [{"name": CONFIG_DIR_VOLUME, "mountPath": "/etc/ucm", "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": CONFIG_DIR_VOLUME, "configMap": {"name": f"{owner.name}-config"}}]
    for v in role.volumes:
        mounts.append({"name": v.name, "mountPath": v.mount_path, **({"readOnly": True} if v.read_only else {})})
        volumes.append({"name": v.name, **v.source})
    if role.component in ENGINES:
        # vLLM's workers exchange tensors through shared memory; the default 64 MiB /dev/shm is too small.
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    env += [{"name": k, "value": v} for k, v in role.env.items()]
    env += [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}}
        for k, ref in role.secret_env.items()
    ]
    container: dict[str, Any] = {
        "name": role.component,
        "image": role.image or spec.image.reference(cpu=_without_gpus(spec, role)),
        "imagePullPolicy": spec.image.pull_policy,
        "command": command,
        "env": env,
        "ports": [{"name": p.name, "containerPort": p.number, "protocol": "TCP"} for p in role.ports if serves],
        "volumeMounts": mounts,
        "resources": _resources(role),
    }
    probes = (("readinessProbe", role.readiness), ("livenessProbe", role.liveness), ("startupProbe", role.startup))
    for key, probe in probes if serves else ():
        if probe is not None:
            container[key] = _probe(probe)
    # A worker outlives its leader's drain (its ranks serve the leader's requests to the end).
    stop_delay = role.drain_delay_s if serves else role.drain_delay_s + role.drain_timeout_s
    if stop_delay:
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": stop_delay}}}
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": role.drain_delay_s + role.drain_timeout_s + STOP_SLACK_S,
        "automountServiceAccountToken": role.component == "proxy",
    }
    # Every pod passes the "restricted" Pod Security profile (apart from hostPath volumes a spec
    # asks for): non-root, no privilege escalation, no capabilities, the runtime's seccomp profile.
    # The images' own users: ucm (1000) in the runtime image, 65532 in the proxy's.
    uid = PROXY_UID if role.component == "proxy" else RUNTIME_UID
    pod["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,  # volumes (a store's RWX claim) writable by the group the pods share
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    if role.component == "proxy":
        pod["serviceAccountName"] = f"{owner.name}-proxy"
        container["securityContext"]["readOnlyRootFilesystem"] = True  # it writes nothing
    if spec.image.pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.image.pull_secrets]
    if role.pool is not None:
        if role.pool.node_selector:
            pod["nodeSelector"] = dict(role.pool.node_selector)
        if role.pool.tolerations:
            pod["tolerations"] = list(role.pool.tolerations)
        if role.pool.affinity:
            pod["affinity"] = dict(role.pool.affinity)
        if role.group is not None and role.group.topology_key:
            pod["affinity"] = _with_group_affinity(pod.get("affinity") or {}, owner, role, role.group.topology_key)
        if role.pool.env_from:
            container["envFrom"] = [e.model_dump(by_alias=True, exclude_defaults=True) for e in role.pool.env_from]
    if role.steps:
        pod["initContainers"] = [_step_container(container, step) for step in role.steps]
    config_hash = digest({f: plan.files[f] for f in role.files})
    return {
        "metadata": {"labels": labels(owner.name, role.component), "annotations": {CONFIG_HASH: config_hash}},
        "spec": pod,
    }


def _step_container(engine: dict[str, Any], step: Step) -> dict[str, Any]:
    """An init container running ``step`` as ``engine``'s container runs (image, environment,
    security), with the volumes the step writes mounted read-write, and without GPUs: a download
    needs none, while a namespace's quota may need its requests and limits."""
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    resources = {k: {r: q for r, q in v.items() if r != "nvidia.com/gpu"} for k, v in engine["resources"].items()}
    out = {
        "name": step.name,
        "image": engine["image"],
        "imagePullPolicy": engine["imagePullPolicy"],
        "command": step.command,
        "env": engine["env"],
        "volumeMounts": [{k: v for k, v in mounts[name].items() if k != "readOnly"} for name in step.writes],
        "resources": {k: v for k, v in resources.items() if v},
        "securityContext": engine["securityContext"],
    }
    if "envFrom" in engine:
        out["envFrom"] = engine["envFrom"]
    return out


def _without_gpus(spec: UCMDeploymentSpec, role: Role) -> bool:
    """Whether ``role`` runs the CPU flavour of the runtime image: an engine of a pool without GPUs,
    or another role (the Mooncake master) of a deployment none of whose engines has GPUs, so that
    an all-CPU cluster needs only the CPU image."""
    pools = [role.pool] if role.pool is not None else [getattr(spec, pool) for pool in ENGINES]
    return all(pool.resources.gpus == 0 for pool in pools)


def _deployment(owner: Owner, spec: UCMDeploymentSpec, plan: Plan, role: Role) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owner.meta(role.name, role.component),
        "spec": {
            # An autoscaled pool's count is the autoscaler's: absent here, a merge patch leaves it be.
            **({} if autoscaling(role) else {"replicas": role.replicas}),
            "selector": {"matchLabels": selector(owner.name, role.component)},
            **_strategy(role),
            "template": _template(owner, spec, plan, role, role.command),
        },
    }


def _leader_worker_set(owner: Owner, spec: UCMDeploymentSpec, plan: Plan, role: Role) -> dict[str, Any]:
    """An engine pool of multi-pod engines: one group (leader + workers) per engine, created,
    restarted (any pod's failure recreates its group: the ranks cannot rejoin a running engine) and
    rolled as a unit. Not named like the pool's Service: the controller makes a headless Service of
    the set's own name for the pods' addresses."""
    group = role.group
    assert group is not None and role.pool is not None
    rollout = role.pool.rollout
    return {
        "apiVersion": f"{LWS_GROUP}/v1",
        "kind": "LeaderWorkerSet",
        "metadata": owner.meta(group_name(role), role.component),
        "spec": {
            **({} if autoscaling(role) else {"replicas": role.replicas}),
            "leaderWorkerTemplate": {
                "size": group.size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _template(owner, spec, plan, role, role.command),
                "workerTemplate": _template(owner, spec, plan, role, group.worker_command, serves=False),
            },
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "maxSurge": rollout.max_surge,
                    "maxUnavailable": rollout.max_unavailable,
                },
            },
            "startupPolicy": "LeaderCreated",
        },
    }


def group_name(role: Role) -> str:
    """The LeaderWorkerSet of a pool of multi-pod engines (after the deployment's name)."""
    return f"{role.name}-group"


def workload(owner: Owner, role: Role) -> dict[str, str]:
    """What runs ``role``'s pods, as a reference (an autoscaler's target)."""
    if role.group is not None:
        return {"apiVersion": f"{LWS_GROUP}/v1", "kind": "LeaderWorkerSet", "name": f"{owner.name}-{group_name(role)}"}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{owner.name}-{role.name}"}


def _with_group_affinity(affinity: dict[str, Any], owner: Owner, role: Role, topology_key: str) -> dict[str, Any]:
    """``affinity`` plus a preference for the pods of one group to share ``topology_key``'s value
    (the group's own key label, which the controller sets, picks the peers)."""
    term = {
        "weight": 100,
        "podAffinityTerm": {
            "labelSelector": {"matchLabels": selector(owner.name, role.component)},
            "matchLabelKeys": [LWS_GROUP_KEY],
            "topologyKey": topology_key,
        },
    }
    pod_affinity = dict(affinity.get("podAffinity") or {})
    preferred = [*(pod_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []), term]
    return {**affinity, "podAffinity": {**pod_affinity, "preferredDuringSchedulingIgnoredDuringExecution": preferred}}


def _strategy(role: Role) -> dict[str, Any]:
    """Engine pools roll as their spec says (default: surge 1, none unavailable: capacity kept);
    other roles keep Kubernetes' default."""
    if role.pool is None:
        return {}
    rollout = role.pool.rollout
    rolling = {"maxSurge": rollout.max_surge, "maxUnavailable": rollout.max_unavailable}
    return {"strategy": {"type": "RollingUpdate", "rollingUpdate": rolling}}


def _service(owner: Owner, spec: UCMDeploymentSpec, role: Role) -> dict[str, Any]:
    if role.component == "proxy":
        svc = spec.proxy.service
        body: dict[str, Any] = {
            "type": svc.type,
            "ports": [{"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP"}],
        }
    else:
        body = {
            "ports": [{"name": p.name, "port": p.number, "targetPort": p.name, "protocol": "TCP"} for p in role.ports]
        }
        if role.component in ENGINES:
            body["clusterIP"] = "None"  # headless: the proxy discovers pods through its EndpointSlices
    body["selector"] = serving_pods(owner.name, role)
    return {"apiVersion": "v1", "kind": "Service", "metadata": owner.meta(role.name, role.component), "spec": body}


def _pdb(owner: Owner, role: Role) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owner.meta(role.name, role.component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(owner.name, role.component)}},
    }


def _proxy_rbac(owner: Owner) -> list[dict[str, Any]]:
    """The proxy watches its pools' EndpointSlices and writes its PD path check into its own
    resource's status (``status.pdPath``); nothing else."""
    name = f"{owner.name}-proxy"
    rules = [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": [GROUP],
            "resources": [f"{PLURAL}/status"],
            "resourceNames": [owner.name],
            "verbs": ["patch"],
        },
    ]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": owner.meta("proxy", "proxy")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": owner.meta("proxy", "proxy"),
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": owner.meta("proxy", "proxy"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def _network_policies(owner: Owner, spec: UCMDeploymentSpec, plan: Plan) -> list[dict[str, Any]]:
    """Engines accept this deployment's proxy (on their API port, and prefill's KV event ports) and
    each other (KV transfer), and the scrapers ``monitoring.scrapers`` names on their API port (vLLM's
    /metrics); a Mooncake
    master accepts this deployment's engines. Nothing else in the cluster reaches them (kubelet
    probes are not subject to NetworkPolicies). The proxy is the entry point: open."""
    engines = {
        "matchLabels": {LABEL_INSTANCE: owner.name},
        "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": list(ENGINES)}],
    }
    proxy = {"podSelector": {"matchLabels": selector(owner.name, "proxy")}}
    scrapers = [_peer(s) for s in spec.monitoring.scrapers]
    policies = [
        _network_policy(
            owner,
            "engines",
            engines,
            [
                {"from": [proxy, *scrapers], "ports": [{"port": "http", "protocol": "TCP"}]},
                # The KV events carry prompts' tokens: the proxy alone subscribes (no scraper).
                *([{"from": [proxy], "ports": _event_ports}] if spec.proxy.kv_events else []),
                {"from": [{"podSelector": engines}]},
            ],
        )
    ]
    for role in plan.roles:
        if role.component in STORE_COMPONENTS:
            policies.append(
                _network_policy(
                    owner,
                    role.name,
                    {"matchLabels": selector(owner.name, role.component)},
                    [
                        {"from": [{"podSelector": engines}]},
                    ],
                )
            )
    return policies


_event_ports = [{"port": name, "protocol": "TCP"} for name in ("kv-events", "kv-replay")]


def _peer(scraper: Scraper) -> dict[str, Any]:
    peer: dict[str, Any] = {}
    if scraper.namespace_selector is not None:
        peer["namespaceSelector"] = {"matchLabels": dict(scraper.namespace_selector)}
    if scraper.pod_selector is not None:
        peer["podSelector"] = {"matchLabels": dict(scraper.pod_selector)}
    return peer


def _network_policy(owner: Owner, suffix: str, pods: dict[str, Any], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": owner.meta(suffix, None),
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }
