"""Every object the operator renders and every manifest the chart renders is valid Kubernetes
(kubernetes-validate --strict, offline schemas); the chart lints, and its values are checked."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.operator.conftest import CHART, ROOT, helm, run_helm
from ucm import __version__
from ucm.deploy.autoscaling import Autoscaler, pods_of
from ucm.deploy.kubernetes import DESIRED_HASH, Owner, render
from ucm.deploy.monitors import Monitors
from ucm.deploy.monitors import from_args as monitors_from_args
from ucm.deploy.plan import build_plan
from ucm.deploy.policy import DEPLOYMENT_PATTERN, allowable_env_pattern
from ucm.deploy.policy import from_args as policy_from_args
from ucm.deploy.roles import PlanError, Site
from ucm.deploy.spec import UCMDeploymentSpec
from ucm_operator.cli import build_parser

EXAMPLES = sorted((ROOT / "examples").glob("ucmdeployment-*.yaml"))
VARIANTS = {
    "mooncake-external": {
        "model": {"source": {"hf": "Qwen/Qwen3-0.6B"}},
        "store": {"type": "mooncake", "mooncake": {"address": "mc:50051", "metadataServer": "http://mc:8080/metadata"}},
        "proxy": {"apiKeySecret": {"name": "keys"}, "service": {"type": "NodePort"}},
    },
    "nfs-cache-gpus": {
        "model": {"source": {"hostPath": "/models/llama"}, "extraArgs": ["--max-num-seqs", "64"]},
        "prefill": {
            "replicas": 2,
            "parallel": {"tensor": 2},
            "resources": {"gpus": 2, "requests": {"cpu": "8", "memory": "64Gi"}},
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        },
        "decode": {"parallel": {"tensor": 2}, "resources": {"gpus": 2}},
        "store": {"type": "nfs", "nfs": {"server": "10.0.0.2", "path": "/kv"}, "cacheSize": "16Gi"},
        "image": {"pullSecrets": ["regcred"]},
    },
    "multi-node-cpu-autoscaled": {
        "model": {"source": {"hf": "Qwen/Qwen3-0.6B"}},
        "prefill": {"parallel": {"tensor": 2, "nodes": 2}, "resources": {"gpus": 0}},
        "decode": {
            "parallel": {"tensor": 2, "nodes": 2, "topologyKey": "rack"},
            "resources": {"gpus": 0},
            "autoscaling": {"maxReplicas": 4},
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        },
        "store": {"type": "nfs", "nfs": {"server": "10.0.0.2", "path": "/kv"}},
    },
    "autoscaled-rolling-monitored": {
        "model": {"source": {"hf": "Qwen/Qwen3-0.6B"}},
        "prefill": {
            "autoscaling": {"maxReplicas": 4, "signal": "proxy_in_flight"},
            "rollout": {"maxSurge": 2, "maxUnavailable": 1},
        },
        "decode": {
            "autoscaling": {"minReplicas": 2, "maxReplicas": 8, "signal": "kv_cache_usage", "target": 0.75},
            "drainTimeoutS": 900,
        },
        "store": {"type": "nfs", "nfs": {"server": "10.0.0.2", "path": "/kv"}},
        "monitoring": {"scrapers": [{"namespaceSelector": {"kubernetes.io/metadata.name": "monitoring"}}]},
        "proxy": {"metricsAuth": True},
    },
    "lora-every-source-multi-node": {
        "model": {"source": {"pvc": {"claimName": "models", "path": "/llama"}}, "servedName": "llama"},
        "prefill": {
            "resources": {"gpus": 1, "requests": {"cpu": "8"}, "limits": {"memory": "64Gi"}},
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
            "envFrom": [{"secretRef": {"name": "hf-all"}, "prefix": "HF_"}],
        },
        "decode": {"parallel": {"tensor": 2, "nodes": 2}, "resources": {"gpus": 1}},
        "store": {"type": "posix", "pvc": {"claimName": "kv"}},
        "lora": {
            "adapters": [
                {"name": "sql", "source": {"pvc": {"claimName": "adapters", "path": "/sql"}}},
                {"name": "legal", "source": {"pvc": {"claimName": "models", "path": "/lora/legal"}}},
                {"name": "tone", "source": {"hostPath": "/data/adapters/tone"}},
                {
                    "name": "org/hub",
                    "source": {"hf": "org/adapter", "revision": "0123456789abcdef0123456789abcdef01234567"},
                },
            ],
            "maxCpuAdapters": 8,
        },
    },
}


# LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, multi-pod engines): no schema package for it can be
# installed here (kubernetes-validate knows core kinds only; kubernetes-models has no LWS), so its
# shape is written from the project's published API reference (its Go types: LeaderWorkerSetSpec and
# what it holds), and each pod template inside it is checked as a core PodTemplate.
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"enum": ["leaderworkerset.x-k8s.io/v1"]},
        "kind": {"enum": ["LeaderWorkerSet"]},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "leaderTemplate": {"type": "object"},
                        "workerTemplate": {"type": "object"},
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {
                            "enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]
                        },
                        "subGroupPolicy": {"type": "object"},
                        "volumeClaimTemplates": {"type": "array"},
                        "persistentVolumeClaimRetentionPolicy": {"type": "object"},
                    },
                },
                "rolloutStrategy": {
                    "type": "object",
                    "required": ["type"],
                    "additionalProperties": False,
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "partition": {"type": "integer", "minimum": 0},
                                "maxUnavailable": {"type": ["integer", "string"]},
                                "maxSurge": {"type": ["integer", "string"]},
                            },
                        },
                    },
                },
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "networkConfig": {
                    "type": "object",
                    "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}},
                },
            },
        },
    },
}


def as_core(docs: list[dict]) -> list[dict]:
    """``docs`` with each LeaderWorkerSet checked against LWS_SCHEMA and replaced by its pod templates
    as core PodTemplates, for kubernetes-validate."""
    out = []
    for doc in docs:
        if doc["kind"] != "LeaderWorkerSet":
            out.append(doc)
            continue
        jsonschema.Draft4Validator(LWS_SCHEMA).validate(doc)
        templates = doc["spec"]["leaderWorkerTemplate"]
        for part in ("leaderTemplate", "workerTemplate"):
            meta = {"name": f"{doc['metadata']['name']}-{part.lower()}", "namespace": doc["metadata"]["namespace"]}
            out.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta, "template": templates[part]})
    return out


def validate_strict(docs: list[dict], tmp_path: Path) -> None:
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all(as_core(docs), sort_keys=False))
    exe = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(exe), "--strict", "-k", "1.33.0", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


NODE_MODELS = Path(sys.executable).parent.parent / "node"  # scripts/install-node-models.sh
# Kinds kubernetes-validate does not know, checked against their projects' own CRD schemas.
MODELS = {
    "ScaledObject": "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject",
    "PodMonitor": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor",
    "ServiceMonitor": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor",
    "PrometheusRule": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule",
}
VALIDATE_MODELS = """
import { readFileSync } from "node:fs";
const { modules, objects } = JSON.parse(readFileSync(0, "utf8"));
const errors = [];
for (const obj of objects) {
  const model = (await import(modules[obj.kind]))[obj.kind];
  try { new model(obj).validate(); } catch (e) { errors.push(`${obj.kind} ${obj.metadata.name}: ${e}`); }
}
if (errors.length) { console.error(errors.join("\\n")); process.exit(1); }
"""


def validate_models(docs: list[dict]) -> None:
    """ScaledObjects, PodMonitors and ServiceMonitors against KEDA's and the Prometheus Operator's
    own schemas (the npm packages of kubernetes-models)."""
    objects = [d for d in docs if d["kind"] in MODELS]
    r = subprocess.run(
        ["node", "--input-type=module", "-e", VALIDATE_MODELS],
        input=json.dumps({"modules": MODELS, "objects": objects}),
        capture_output=True,
        text=True,
        cwd=NODE_MODELS,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr[-4000:]


def specs() -> list[tuple[str, dict]]:
    out = [(p.stem, yaml.safe_load(p.read_text())["spec"]) for p in EXAMPLES]
    return out + list(VARIANTS.items())


@pytest.mark.parametrize("provider", ["keda", "hpa"])
@pytest.mark.parametrize(("name", "spec"), specs(), ids=[n for n, _ in specs()])
def test_rendered_objects_are_valid_kubernetes(name, spec, provider, tmp_path):
    model = UCMDeploymentSpec.model_validate(spec)
    plan = build_plan("demo", model, Site("kubernetes", namespace="serving"))
    monitors = Monitors(enabled=True, labels=(("release", "kube-prometheus"),))
    objects = render(Owner("demo", "serving", "0000-uid"), model, plan, Autoscaler(provider=provider), monitors)
    validate_strict([o for o in objects if o["kind"] not in MODELS], tmp_path)
    validate_models(objects)
    scalers = {"keda": "ScaledObject", "hpa": "HorizontalPodAutoscaler"}
    scaled = [o["metadata"]["name"] for o in objects if o["kind"] == scalers[provider]]
    assert scaled == [f"demo-{p}" for p in ("prefill", "decode") if spec.get(p, {}).get("autoscaling")]
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))
    assert all(o["metadata"]["annotations"][DESIRED_HASH] for o in objects)


def test_a_pool_scaled_to_zero_is_woken_by_the_requests_that_found_it_empty(tmp_path):
    """At zero the pool's own series are gone (KEDA reads that as 0, which never activates): a second
    trigger on the proxy's count of requests that found no backend asks for one engine."""
    spec = UCMDeploymentSpec.model_validate(
        {**VARIANTS["autoscaled-rolling-monitored"], "decode": {"autoscaling": {"minReplicas": 0, "maxReplicas": 4}}}
    )
    objects = render(
        Owner("demo", "serving", "u"), spec, build_plan("demo", spec, Site("kubernetes", namespace="serving"))
    )
    validate_models(objects)
    scaled = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "ScaledObject"}
    assert [t.get("name") for t in scaled["demo-prefill"]["triggers"]] == [None]  # minReplicas 1: no wake
    signal, wake = scaled["demo-decode"]["triggers"]
    assert scaled["demo-decode"]["minReplicaCount"] == 0
    assert scaled["demo-decode"]["cooldownPeriod"] == 1800  # a woken engine outlives its loading
    assert "cooldownPeriod" not in scaled["demo-prefill"]
    assert wake["name"] == "wake-from-zero"
    assert (wake["metadata"]["threshold"], wake["metadata"]["activationThreshold"]) == ("1", "0")
    query = wake["metadata"]["query"]
    assert query.startswith("clamp_max(") and query.endswith(", 1)")
    assert (
        'ucm_proxy_unserved_requests_total{namespace="serving",pod=~"demo-proxy-[a-z0-9]+(-[a-z0-9]+)?",role="decode"}'
        in query
    )
    # Both queries are PromQL Prometheus accepts (promtool parses them as recording rules).
    rules = {
        "groups": [
            {
                "name": "q",
                "rules": [{"record": f"q{i}", "expr": t["metadata"]["query"]} for i, t in enumerate((signal, wake))],
            }
        ]
    }
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    r = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


LONG = "llama-3-1-70b-instruct-production-eu1-ab-decode"  # 48 characters


@pytest.mark.parametrize(
    ("workload", "kind", "mine", "not_mine"),
    [
        ("llama-decode", "Deployment", ["llama-decode-7d9c5b8f6-x2x9k"], ["llama-decode-prefill-5c6d7-abcde"]),
        # A ReplicaSet cuts its pods' prefix to 58 characters: the hash and the suffix run together.
        (LONG, "Deployment", [(LONG + "-5d8f9c7b4")[:58] + "x2x9k"], [LONG + "-prefill-5d8f9c7b4-x2x9k"]),
        ("llama-proxy", "Deployment", ["llama-proxy-6b7f9d-9zq2w"], ["llama-proxy-decode-6b7f9-q2w9z"]),
        ("a-decode-group", "LeaderWorkerSet", ["a-decode-group-0", "a-decode-group-3-1"], ["a-decode-group-x-0-1"]),
    ],
)
def test_autoscalers_count_the_pools_pods_and_no_neighbours(workload, kind, mine, not_mine):
    """A deployment named `llama-decode` beside `llama` has pods `llama-decode-prefill-...`: a
    `llama-decode-.*` query would count them into llama's decode pool. PromQL regexes are anchored."""
    pattern = re.compile(pods_of(workload, kind))
    assert all(pattern.fullmatch(name) for name in mine)
    assert not any(pattern.fullmatch(name) for name in not_mine)


def test_render_is_deterministic_and_hash_tracks_content():
    spec = UCMDeploymentSpec.model_validate(VARIANTS["nfs-cache-gpus"])
    site = Site("kubernetes", namespace="serving")
    owner = Owner("demo", "serving", "u")
    a = render(owner, spec, build_plan("demo", spec, site))
    b = render(owner, spec, build_plan("demo", spec, site))
    assert a == b
    changed = spec.model_copy(update={"decode": spec.decode.model_copy(update={"replicas": 5})})
    c = render(owner, changed, build_plan("demo", changed, site))
    differ = {o["metadata"]["name"] + "/" + o["kind"] for o, p in zip(a, c, strict=True) if o != p}
    assert differ == {"demo-decode/Deployment"}


def deployments(spec: dict) -> dict[str, dict]:
    """The Deployments of deployment ``d`` in namespace ``ns`` rendered from ``spec``, by name."""
    parsed = UCMDeploymentSpec.model_validate(spec)
    objects = render(Owner("d", "ns", "u"), parsed, build_plan("d", parsed, Site("kubernetes", namespace="ns")))
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}


def test_engines_follow_the_operators_release_unless_their_tag_is_pinned(monkeypatch):
    """The CRD stores no tag default in the resource: an upgraded operator (which renders the engines'
    commands) moves unpinned engines to its own release, as it does the proxy."""

    def images(spec: dict) -> set[str]:
        return {c["image"] for o in deployments(spec).values() for c in o["spec"]["template"]["spec"]["containers"]}

    spec = VARIANTS["nfs-cache-gpus"]
    monkeypatch.setattr("ucm.deploy.spec.__version__", "9.9.9")
    monkeypatch.setattr("ucm.deploy.plan.__version__", "9.9.9")
    assert images(spec) == {"ucm/runtime:9.9.9", "ucm/proxy:9.9.9"}
    pinned = {**spec, "image": {"tag": "0.1.0"}}
    assert images(pinned) == {"ucm/runtime:0.1.0", "ucm/proxy:9.9.9"}
    # pods without GPUs run the runtime's CPU flavour
    cpu = {**spec, "decode": {**spec["decode"], "resources": {"gpus": 0}}}
    assert images(cpu) == {"ucm/runtime:9.9.9", "ucm/runtime:9.9.9-cpu", "ucm/proxy:9.9.9"}


def test_gpus_and_scheduling_reach_the_pod():
    prefill = deployments(VARIANTS["nfs-cache-gpus"])["d-prefill"]
    pod = prefill["spec"]["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "2"
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"][0]["key"] == "gpu"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in pod["containers"][0]["env"]
    assert {"name": "kv", "nfs": {"server": "10.0.0.2", "path": "/kv"}} in pod["volumes"]


def test_chart_lints(tmp_path):
    helm("lint", "--strict", str(CHART), tmp=tmp_path)


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["--set", "metrics.service.enabled=true", "--set", "watchNamespaces={serving,batch}"],
        # a Prometheus duration of two units, checked against the Prometheus Operator's own schema
        [
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--set",
            "metrics.serviceMonitor.interval=1m30s",
            "--set",
            "image.tag=dev",
        ],
        [
            "--set",
            "policy.hostPathPrefixes={/data/models}",
            "--set",
            "policy.anyScheduling=true",
            "--set",
            "policy.allowedEnv={LD_PRELOAD}",
            "--set",
            "policy.allowedNfs={nfs.example.com:/exports/a}",
            "--set",
            "policy.allowedRuntimeLora={serving/chat}",
        ],
        [
            "--set",
            "monitoring.prometheusOperator=true",
            "--set",
            "monitoring.labels.release=prom",
            "--set",
            "monitoring.grafanaDashboard.enabled=true",
        ],
    ],
    ids=["defaults", "metrics-namespaces", "servicemonitor", "policy", "monitors"],
)
def test_chart_renders_valid_manifests(values, tmp_path):
    out = helm("template", "ucm", str(CHART), "--namespace", "ucm-system", "--include-crds", *values, tmp=tmp_path)
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"} <= kinds
    # The Prometheus Operator's custom resources, against its own schemas; the rest strictly.
    validate_strict([d for d in docs if d["kind"] not in MODELS], tmp_path)
    validate_models(docs)
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    if "watchNamespaces={serving,batch}" in values:
        assert "--namespace=serving" in args and "--namespace=batch" in args
    assert "--allow-image-prefix=ucm/" in args
    if "policy.anyScheduling=true" in values:
        assert "--allow-host-path=/data/models" in args and "--allow-any-scheduling" in args
        assert "--allow-env=LD_PRELOAD" in args and "--allow-nfs=nfs.example.com:/exports/a" in args
    # The operator accepts what the chart passes.
    parsed = build_parser().parse_args(args)
    assert parsed.allow_host_path == (["/data/models"] if "policy" in str(values) else [])
    assert policy_from_args(parsed).allowed_env == (("LD_PRELOAD",) if "policy" in str(values) else ())
    nfs = (("nfs.example.com", "/exports/a"),) if "policy" in str(values) else ()
    assert policy_from_args(parsed).nfs_exports == nfs
    assert policy_from_args(parsed).runtime_lora == (("serving/chat",) if "policy" in str(values) else ())
    monitored = "monitoring.prometheusOperator=true" in values
    assert monitors_from_args(parsed) == Monitors(monitored, (("release", "prom"),) if monitored else ())
    assert deploy["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_the_chart_runs_two_replicas_that_elect_a_leader(tmp_path):
    """Two replicas, one leading through a Lease in the release's namespace (a Role there, no
    cluster-wide right to Leases), a PodDisruptionBudget keeping one; without leader election,
    one replica replaced by Recreate."""

    def render(*values: str) -> dict[tuple[str, str], dict]:
        out = helm("template", "u", str(CHART), "--namespace", "ucm-system", *values, tmp=tmp_path)
        return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}

    docs = render()
    deploy = docs["Deployment", "u-ucm-operator"]
    assert deploy["spec"]["replicas"] == 2 and "strategy" not in deploy["spec"]  # RollingUpdate
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    parsed = build_parser().parse_args(container["args"])
    assert parsed.leader_election and parsed.lease_name == "u-ucm-operator"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}
    role = docs["Role", "u-ucm-operator-leader-election"]
    assert role["metadata"]["namespace"] == "ucm-system"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]}
    ]
    binding = docs["RoleBinding", "u-ucm-operator-leader-election"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == deploy["spec"]["template"]["spec"]["serviceAccountName"]
    assert not any("leases" in r["resources"] for r in docs["ClusterRole", "u-ucm-operator"]["rules"])
    pdb = docs["PodDisruptionBudget", "u-ucm-operator"]
    assert pdb["spec"] == {"minAvailable": 1, "selector": deploy["spec"]["selector"]}

    single = render("--set", "leaderElection.enabled=false")
    deploy = single["Deployment", "u-ucm-operator"]
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-election" not in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not {k for k in single if k[0] in ("Role", "PodDisruptionBudget")}
    refused = run_helm("template", "u", str(CHART), "--set", "replicas=0", tmp=tmp_path)
    assert refused.returncode != 0 and "'/replicas': minimum: got 0, want 1" in refused.stderr, refused.stderr


def test_the_chart_upgrades_the_crd_with_the_release_and_keeps_it_on_uninstall(tmp_path):
    """The CRD is a template (Helm never upgrades a chart's crds/): what the models generate, with
    helm.sh/resource-policy keep; crds.install=false leaves it to whoever manages it."""

    def crds(*values: str) -> list[dict]:
        out = helm("template", "u", str(CHART), "--namespace", "ucm-system", *values, tmp=tmp_path)
        return [d for d in yaml.safe_load_all(out) if d and d["kind"] == "CustomResourceDefinition"]

    generated = yaml.safe_load((ROOT / "crds" / "ucm.io_ucmdeployments.yaml").read_text())
    [crd] = crds()
    assert crd["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert crd == generated
    [unkept] = crds("--set", "crds.keep=false")
    assert "annotations" not in unkept["metadata"]
    assert crds("--set", "crds.install=false") == []
    assert not (CHART / "crds").exists()  # which Helm would install once, and never upgrade


def test_the_charts_allowed_env_names_are_the_operators():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["policy"]["properties"]["allowedEnv"]["items"]["pattern"] == allowable_env_pattern()


def test_the_charts_runtime_lora_deployments_are_what_the_operator_takes():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["policy"]["properties"]["allowedRuntimeLora"]["items"]["pattern"] == DEPLOYMENT_PATTERN


@pytest.mark.parametrize(
    ("flag", "complaint"),
    [
        ("logLevel=loud", "logLevel"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("watchNamespaces={Bad_NS}", "watchNamespaces"),
        ("metrics.port=70000", "port"),
        ("surprise=1", "surprise"),
        ("policy.hostPathPrefixes={relative}", "hostPathPrefixes"),
        ("policy.allowedEnv={LD_*}", "allowedEnv"),
        ("policy.allowedNfs={nfs.example.com}", "allowedNfs"),
        ("policy.allowedNfs={nfs.example.com:exports/a}", "allowedNfs"),
        ("policy.allowedNfs={:/exports/a}", "allowedNfs"),
        ("healthPort=9090", "healthPort and metrics.port are both 9090"),
        ("metrics.serviceMonitor.interval=90", "interval"),
        ("policy.allowedEnv={HF_TOKEN}", "allowedEnv"),  # not refused, so the operator would stop at it
        ("policy.allowedRuntimeLora={chat}", "allowedRuntimeLora"),  # a deployment is NAMESPACE/NAME
    ],
)
def test_chart_values_are_validated(flag, complaint, tmp_path):
    env_home = {f"HELM_{k}_HOME": str(tmp_path / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}
    r = subprocess.run(
        [str(Path(sys.executable).parent / "helm"), "template", "u", str(CHART), "--set", flag],
        capture_output=True,
        text=True,
        env={**env_home, "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode != 0 and complaint in r.stderr, r.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_ucm_render_prints_valid_objects_for_every_example(example, tmp_path):
    exe = Path(sys.executable).parent / "ucm"
    # The node directories and NFS export the examples mount, as their comments tell their users.
    bounds = ["--allow-host-path", "/models", "--allow-host-path", "/3fs", "--allow-nfs", "10.0.0.20:/exports/kv"]
    r = subprocess.run(
        [str(exe), "render", "-f", str(example), "-n", "serving", *bounds], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    docs = list(yaml.safe_load_all(r.stdout))
    assert r.stdout.startswith("---\n") and all(d["metadata"]["namespace"] == "serving" for d in docs)
    assert all("ownerReferences" not in d["metadata"] for d in docs)  # no live resource, no uid to point at
    validate_strict(docs, tmp_path)


def test_the_proxy_pod_has_bounded_resources():
    model = UCMDeploymentSpec.model_validate(specs()[0][1])
    objects = render(Owner("demo", "serving", "uid"), model, build_plan("demo", model, Site("kubernetes")))
    proxy = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-proxy")
    resources = proxy["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["memory"] and resources["limits"]["memory"]


def test_network_policies_let_only_the_proxy_reach_engines_and_only_engines_the_master():
    spec = {"model": {"source": {"hf": "m"}}, "store": {"type": "mooncake", "mooncake": {"master": {}}}}
    s = UCMDeploymentSpec.model_validate(spec)
    objs = render(Owner("x", "ns", None), s, build_plan("x", s, Site("kubernetes", namespace="ns")))
    policies = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "NetworkPolicy"}
    assert set(policies) == {"x-engines", "x-mooncake-master"}
    engines = policies["x-engines"]
    assert engines["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    from_proxy, events_from_proxy, from_engines = engines["ingress"]
    assert events_from_proxy["from"] == from_proxy["from"][:1]  # prefill's KV events: the proxy alone
    proxy_labels = from_proxy["from"][0]["podSelector"]["matchLabels"]
    assert proxy_labels == {"app.kubernetes.io/instance": "x", "app.kubernetes.io/component": "proxy"}
    assert from_proxy["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert from_engines["from"][0]["podSelector"] == engines["podSelector"]  # KV transfer among engines
    master = policies["x-mooncake-master"]
    assert master["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "mooncake-master"
    assert master["ingress"] == [{"from": [{"podSelector": engines["podSelector"]}]}]
    # Every pod those selectors pick carries the labels they match on.
    engine_pods = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] in ("x-prefill", "x-decode")]
    for d in engine_pods:
        pod_labels = d["spec"]["template"]["metadata"]["labels"]
        assert pod_labels["app.kubernetes.io/instance"] == "x"
        assert pod_labels["app.kubernetes.io/component"] in ("prefill", "decode")


def test_with_watch_namespaces_the_operator_holds_rights_in_those_namespaces_only(tmp_path):
    def rbac(*values: str) -> list[dict]:
        out = helm("template", "u", str(CHART), "--namespace", "ucm-system", *values, tmp=tmp_path)
        return [d for d in yaml.safe_load_all(out) if d and d["kind"] in ("ClusterRole", "RoleBinding")]

    everywhere = {d["metadata"]["name"]: d for d in rbac()}
    scoped = rbac("--set", "watchNamespaces={serving,batch}")
    roles = {d["metadata"]["name"]: d for d in scoped if d["kind"] == "ClusterRole"}
    assert [r["resources"] for r in roles["u-ucm-operator"]["rules"]] == [["customresourcedefinitions"]]
    # (the leader election's RoleBinding, to its Lease Role in the release's namespace, aside)
    bindings = [d for d in scoped if d["kind"] == "RoleBinding" and d["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["batch", "serving"]
    assert all(
        b["roleRef"] == {**b["roleRef"], "kind": "ClusterRole", "name": "u-ucm-operator-namespaced"} for b in bindings
    )
    # The same rights, granted per namespace instead of everywhere.
    assert (
        roles["u-ucm-operator"]["rules"] + roles["u-ucm-operator-namespaced"]["rules"]
        == (everywhere["u-ucm-operator"]["rules"])
    )
    validate_strict(scoped, tmp_path)


def matches(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    return ok and all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def test_monitors_scrape_every_engine_pod_and_the_proxy_and_nothing_else():
    spec = UCMDeploymentSpec.model_validate(specs()[0][1])
    plan = build_plan("demo", spec, Site("kubernetes", namespace="serving"))
    assert not [o for o in render(Owner("demo", "serving", "u"), spec, plan) if o["kind"] in MODELS]  # off by default
    objects = render(Owner("demo", "serving", "u"), spec, plan, None, Monitors(True, (("release", "prom"),)))
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in objects if o["kind"] == "Deployment"
    }
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    (pod_monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    (service_monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert pod_monitor["metadata"]["labels"]["release"] == "prom"
    scraped = {name for name, labels in pods.items() if matches(pod_monitor["spec"]["selector"], labels)}
    assert scraped == {"demo-prefill", "demo-decode"}
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "30s")
    # The labels the shipped rules and dashboard group by, from each pod's own labels.
    for name, labels in pods.items():
        meta = {
            f"__meta_kubernetes_pod_label_{k.replace('.', '_').replace('/', '_').replace('-', '_')}": v
            for k, v in labels.items()
        }
        relabelled = {r["targetLabel"]: meta[r["sourceLabels"][0]] for r in endpoint["relabelings"]}
        assert relabelled == {"ucm_deployment": "demo", "ucm_role": name.removeprefix("demo-")}
    assert service_monitor["spec"]["endpoints"][0]["relabelings"] == endpoint["relabelings"]
    selected = [n for n, s in services.items() if matches(service_monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert selected == ["demo-proxy"]
    assert {p["name"] for p in services["demo-proxy"]["spec"]["ports"]} >= {
        service_monitor["spec"]["endpoints"][0]["port"]
    }


def test_with_metrics_auth_the_proxy_reads_a_generated_token_and_its_service_monitor_sends_it():
    spec = UCMDeploymentSpec.model_validate(VARIANTS["autoscaled-rolling-monitored"])
    plan = build_plan("demo", spec, Site("kubernetes", namespace="serving"))
    assert "metrics-token" in plan.credentials  # generated by the operator, like the backend key
    objects = render(Owner("demo", "serving", "u"), spec, plan, None, Monitors(True))
    (service_monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    (pod_monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    token = {"name": "demo-credentials", "key": "metrics-token"}
    assert service_monitor["spec"]["endpoints"][0]["authorization"] == {"type": "Bearer", "credentials": token}
    assert "authorization" not in pod_monitor["spec"]["podMetricsEndpoints"][0]  # vLLM's /metrics takes none
    proxy = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-proxy")
    volumes = {v["name"]: v for v in proxy["spec"]["template"]["spec"]["volumes"]}
    items = [i["key"] for i in volumes["credentials"]["secret"]["items"]]
    assert items == ["backend-api-key", "metrics-token"]
    config = yaml.safe_load(plan.files["proxy.yaml"])
    assert config["metrics_token_file"] == "/etc/ucm-credentials/metrics-token"
    engines = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] != "demo-proxy"]
    for engine in engines:  # only the proxy reads the token
        secrets = [v for v in engine["spec"]["template"]["spec"].get("volumes", []) if "secret" in v]
        assert all("metrics-token" not in str(v) for v in secrets)
    chosen = spec.model_copy(update={"proxy": spec.proxy.model_copy(update={"config": {"metrics_token_file": "/x"}})})
    with pytest.raises(PlanError, match=r"proxy\.config\.metrics_token_file: set by the deployment"):
        build_plan("demo", chosen, Site("kubernetes", namespace="serving"))


def test_the_mooncake_master_runs_the_cpu_image_where_no_engine_has_gpus():
    """An all-CPU cluster needs only the runtime's CPU flavour (it ships mooncake_master too); with
    any GPU pool the master keeps the CUDA image the GPU engines pull anyway."""

    def master_image(gpus: dict[str, int]) -> str:
        spec = {
            **VARIANTS["nfs-cache-gpus"],
            "store": {"type": "mooncake", "mooncake": {"master": {}}},
            **{pool: {"resources": {"gpus": n}} for pool, n in gpus.items()},
        }
        master = deployments(spec)["d-mooncake-master"]
        return master["spec"]["template"]["spec"]["containers"][0]["image"]

    assert master_image({"prefill": 0, "decode": 0}) == f"ucm/runtime:{__version__}-cpu"
    assert master_image({"prefill": 1, "decode": 0}) == f"ucm/runtime:{__version__}"
    assert master_image({"prefill": 1, "decode": 1}) == f"ucm/runtime:{__version__}"
