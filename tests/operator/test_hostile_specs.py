"""Resources written to get more than a model server: each is refused naming the field (the
operator's own validation, ``plan_of``, with the default policy), or rendered safely. One case runs
through the real operator to show a refusal touches nothing."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.operator.test_operator import NS, SPEC, conditions, eventually
from ucm.deploy.kubernetes import Owner, render
from ucm.deploy.policy import Policy
from ucm_operator.handlers import Invalid, plan_of
from ucm_testing.kmock_operator import Emulator, operator_running

pytestmark = pytest.mark.kmock(cls=Emulator)


def with_(change: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    for dotted, value in change.items():
        *path, last = dotted.split(".")
        node = spec
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return spec


def owner(spec: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "h", "namespace": NS, "uid": "uid-h"}, "spec": spec}


HOSTILE = [
    ({"image.repository": "evil/miner"}, "spec.image.repository: evil/miner is not from an allowed repository (ucm/)"),
    ({"proxy.image": "docker.io/evil/proxy:1"}, "spec.proxy.image: docker.io/evil/proxy:1 is not from an allowed"),
    (
        {"store": {"type": "mooncake", "mooncake": {"master": {"image": "evil/master"}}}},
        "spec.store.mooncake.master.image: evil/master is not from an allowed",
    ),
    ({"model.source": {"hostPath": "/"}}, "spec.model.source.hostPath: / is not under an allowed host path (none"),
    ({"model.source": {"hostPath": "/etc/kubernetes/pki"}}, "spec.model.source.hostPath: /etc/kubernetes/pki is not"),
    (
        {"store": {"type": "ds3fs", "ds3fs": {"mountPath": "/"}}},
        "spec.store.ds3fs.mountPath: / is not under an allowed",
    ),
    (
        {"store": {"type": "nfs", "nfs": {"server": "nfs.other-team.example", "path": "/exports/kv"}}},
        "spec.store.nfs.server: nfs.other-team.example:/exports/kv is not allowed by the operator's policy",
    ),
    ({"decode.tolerations": [{"operator": "Exists"}]}, "spec.decode.tolerations[0]: a toleration needs a key"),
    (
        {"prefill.tolerations": [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}]},
        "spec.prefill.tolerations[0].key: engines may not tolerate control-plane taints",
    ),
    (
        {"decode.nodeSelector": {"node-role.kubernetes.io/control-plane": ""}},
        "spec.decode.nodeSelector.node-role.kubernetes.io/control-plane: engines may not be placed",
    ),
    (
        {
            "decode.affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "node-role.kubernetes.io/master", "operator": "Exists"}]}
                        ]
                    }
                }
            }
        },
        "spec.decode.affinity: engines may not be placed on control-plane nodes",
    ),
    ({"model.extraArgs": ["--trust-remote-code"]}, "spec.model.extraArgs[0]: --trust-remote-code is not allowed"),
    ({"model.extraArgs": ["--trust_remote"]}, "spec.model.extraArgs[0]: --trust-remote-code is not allowed"),
    (
        {"prefill.extraArgs": ["--kv-transfer-config.kv_connector=Evil"]},
        "spec.prefill.extraArgs[0]: --kv-transfer-config is not allowed",
    ),
    ({"decode.extraArgs": ["--max-num-seqs", "8", "--middleware=x.y"]}, "spec.decode.extraArgs[2]: --middleware is"),
    ({"prefill.extraArgs": ["--api-key", "mine"]}, "spec.prefill.extraArgs[0]: --api-key is not allowed"),
    ({"decode.env": [{"name": "VLLM_API_KEY", "value": "x"}]}, "spec.decode.env[0].name: VLLM_API_KEY is set by"),
    ({"decode.env": [{"name": "LD_PRELOAD", "value": "/x.so"}]}, "spec.decode.env[0].name: LD_PRELOAD is not allowed"),
    ({"prefill.envFrom": [{"configMapRef": {"name": "c"}}]}, "spec.prefill.envFrom[0].prefix: without a prefix"),
    ({"proxy.service": {"type": "LoadBalancer"}}, "spec.proxy.apiKeySecret: required with proxy.service.type"),
    ({"proxy.config": {"backend_api_key_file": "/x"}}, "spec.proxy.config.backend_api_key_file: set by the"),
    ({"proxy.config": {"api_keys": ["k"]}}, "spec.proxy.config.api_keys: set by the deployment"),
    (
        {"decode.envFrom": [{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]},
        "spec.decode.envFrom.0: envFrom: exactly one of secretRef, configMapRef",
    ),
    (
        {"store": {"type": "mooncake", "mooncake": {"master": {}}, "mac": True}},
        "spec.store: store.mac: only file stores (posix, nfs, ds3fs) sign blocks, not mooncake",
    ),
    # LoRA adapters: only from where the policy sees, and only those the spec names.
    (
        {"lora": {"adapters": [{"name": "a", "source": {"hostPath": "/etc/kubernetes"}}]}},
        "spec.lora.adapters[0].source.hostPath: /etc/kubernetes is not under an allowed host path (none",
    ),
    (
        {"lora": {"adapters": [{"name": "a", "source": {"hf": "evil/adapter"}}]}},
        "spec.lora.adapters.0.source: lora.adapters.source.revision: required with hf",
    ),
    (
        {"decode.env": [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"}]},
        "spec.decode.env[0].name: VLLM_ALLOW_RUNTIME_LORA_UPDATING is not allowed: lets the engine load",
    ),
    (
        {"prefill.envFrom": [{"secretRef": {"name": "s"}, "prefix": "VLLM_LORA_RESOLVER_"}]},
        "spec.prefill.envFrom[0].prefix: 'VLLM_LORA_RESOLVER_' and a key of the Secret or ConfigMap could make",
    ),
    ({"model.extraArgs": ["--lora-modules", "a=/models/a"]}, "spec.model.extraArgs[0]: --lora-modules: set spec.lora"),
    ({"decode.extraArgs": ["--enable-lora"]}, "spec.decode.extraArgs[0]: --enable-lora: set spec.lora"),
]


@pytest.mark.parametrize(
    ("change", "message"), HOSTILE, ids=[next(iter(c)) + f"-{i}" for i, (c, _) in enumerate(HOSTILE)]
)
def test_a_hostile_spec_is_refused_naming_the_field(change, message):
    refused = plan_of(owner(with_(change)), Policy())
    assert isinstance(refused, Invalid) and refused.message.startswith(message), refused
    assert refused.reason in ("InvalidSpec", "PolicyRefused")


def test_what_the_policy_allows_renders_safely():
    policy = Policy(image_prefixes=("registry.corp/ucm/",), host_path_prefixes=("/data/models",))
    spec = with_(
        {
            "image.repository": "registry.corp/ucm/runtime",
            "proxy.image": "registry.corp/ucm/proxy:1",
            "model.source": {"hostPath": "/data/models/llama"},
            "proxy.apiKeySecret": {"name": "shared", "key": "ucm-keys"},
            "decode.env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
            "decode.envFrom": [
                {"secretRef": {"name": "hf-all"}, "prefix": "HF_"},
                {"configMapRef": {"name": "tun"}, "prefix": "TUN_"},
            ],
        }
    )
    planned = plan_of(owner(spec), policy)
    assert not isinstance(planned, Invalid), planned
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render(Owner("h", NS, "uid-h"), *planned)}
    decode = objs[("Deployment", "h-decode")]["spec"]["template"]["spec"]
    (model,) = [v for v in decode["volumes"] if v["name"] == "model"]
    (mount,) = [m for m in decode["containers"][0]["volumeMounts"] if m["name"] == "model"]
    assert model["hostPath"]["path"] == "/data/models/llama"
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}  # fixed point, read-only
    proxy = objs[("Deployment", "h-proxy")]["spec"]["template"]["spec"]
    (keys,) = [v for v in proxy["volumes"] if v["name"] == "api-keys"]
    assert keys["secret"]["items"] == [{"key": "ucm-keys", "path": "ucm-keys"}]  # not every key of the Secret
    env = {e["name"]: e for e in decode["containers"][0]["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "h-credentials", "key": "backend-api-key"}
    # Whole Secrets as env only where asked; the deployment's own env entries win over them.
    assert decode["containers"][0]["envFrom"] == [
        {"secretRef": {"name": "hf-all"}, "prefix": "HF_"},
        {"configMapRef": {"name": "tun"}, "prefix": "TUN_"},
    ]
    assert "envFrom" not in objs[("Deployment", "h-prefill")]["spec"]["template"]["spec"]["containers"][0]
    escape = {**spec, "model": {**spec["model"], "source": {"hostPath": "/data/models/../../etc"}}}
    assert plan_of(owner(escape), policy) == Invalid(
        "PolicyRefused",
        "spec.model.source.hostPath: /data/models/../../etc is not under an allowed host path (/data/models)",
    )


@pytest.mark.asyncio
async def test_the_operator_reports_a_hostile_spec_and_creates_nothing(kmock, cluster):
    async with operator_running(cluster.url):
        await cluster.apply_ucmd(NS, "h", with_({"image.repository": "evil/miner"}), uid="uid-h")

        async def invalid() -> dict[str, Any]:
            cond = conditions(await cluster.ucmd(NS, "h"))
            assert cond["Degraded"]["status"] == "True" and cond["Degraded"]["reason"] == "PolicyRefused", cond
            return cond

        cond = await eventually(invalid)
        assert "spec.image.repository: evil/miner" in cond["Degraded"]["message"]
        assert await cluster.children(NS, "h") == {}
