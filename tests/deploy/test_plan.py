"""The plan: one description of the stack, read by the operator and by ``ucm up``."""

from __future__ import annotations

import dataclasses
import json
import re
from itertools import count

import pytest
import yaml

from ucm.deploy.plan import BACKENDS_FILE, KV_CONFIG_FILE, KV_DECODE_CONFIG_FILE, PROXY_CONFIG_FILE, build_plan
from ucm.deploy.quantity import quantity_bytes
from ucm.deploy.roles import PlanError, Site
from ucm.deploy.spec import UCMDeploymentSpec
from ucm.integration.vllm.config import parse_connector_config
from ucm_proxy.config import ProxyConfig

BASE = {"model": {"source": {"hostPath": "/models/tiny"}}, "store": {"type": "posix", "pvc": {"claimName": "kv"}}}
K8S = Site("kubernetes", namespace="serving")


def local_site(tmp_path) -> Site:
    ports = count(20000)
    return Site("local", config_dir=str(tmp_path), kv_dir=str(tmp_path / "kv"), ports=lambda role: next(ports))


def plan_for(overrides: dict, site: Site = K8S):
    return build_plan("demo", UCMDeploymentSpec.model_validate({**BASE, **overrides}), site)


def kv(plan) -> dict:
    config = json.loads(plan.files[KV_CONFIG_FILE])
    parse_connector_config(config["kv_connector_extra_config"])  # what the engines will accept
    return config["kv_connector_extra_config"]


def test_kubernetes_plan_roles_and_files():
    plan = plan_for({"decode": {"replicas": 3}})
    assert [(r.name, r.replicas) for r in plan.roles] == [("prefill", 1), ("decode", 3), ("proxy", 1)]
    extra = kv(plan)
    assert extra["store"] == {"spec": "posix", "posix": {"roots": ["/var/lib/ucm/kv"]}}
    assert extra["model_id"] == "/models/tiny"  # same on every pod, so blocks are shared
    decode = plan.role("decode")
    assert decode.command[:4] == ["ucm", "serve", "--kv-config", "/etc/ucm/" + KV_CONFIG_FILE]
    assert "--port" in decode.command and decode.command[decode.command.index("--port") + 1] == "8000"
    proxy = ProxyConfig.model_validate(yaml.safe_load(plan.files[PROXY_CONFIG_FILE]))
    assert proxy.discovery is not None and proxy.discovery.decode_service == "demo-decode"
    assert proxy.host == "0.0.0.0" and proxy.mode == "pd"


def test_local_plan_gives_each_replica_a_port_and_the_proxy_their_urls(tmp_path):
    plan = plan_for({"prefill": {"replicas": 2}, "decode": {"replicas": 1}}, local_site(tmp_path))
    names = [r.name for r in plan.roles]
    assert names == ["prefill-0", "prefill-1", "decode-0", "proxy"]
    ports = [r.ports[0].number for r in plan.roles]
    assert len(set(ports)) == 4
    # The proxy reads its backends from a file `ucm restart` rewrites to roll a pool.
    assert yaml.safe_load(plan.files[PROXY_CONFIG_FILE])["backends_file"] == str(tmp_path / BACKENDS_FILE)
    assert json.loads(plan.files[BACKENDS_FILE]) == {
        "prefill": [f"http://127.0.0.1:{p}" for p in ports[:2]],
        "decode": [f"http://127.0.0.1:{ports[2]}"],
    }
    (tmp_path / BACKENDS_FILE).write_text(plan.files[BACKENDS_FILE])
    proxy = ProxyConfig.model_validate(yaml.safe_load(plan.files[PROXY_CONFIG_FILE]))
    assert proxy.host == "127.0.0.1" and proxy.discovery is None
    assert kv(plan)["store"]["posix"]["roots"] == [str(tmp_path / "kv")]
    assert all(not r.volumes for r in plan.roles)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"store": {"type": "posix", "pvc": {"claimName": "kv"}, "cacheSize": "lots"}}, "store.cacheSize: 'lots'"),
        ({"proxy": {"config": {"port": 9}}}, "proxy.config.port: set by the deployment"),
        ({"proxy": {"config": {"prefill": ["http://x"]}}}, "proxy.config.prefill: set by the deployment"),
        (
            {"proxy": {"service": {"type": "LoadBalancer"}}},
            "proxy.apiKeySecret: required with proxy.service.type LoadBalancer (reachable from outside",
        ),
    ],
)
def test_specs_that_cannot_work_name_the_field(overrides, message):
    with pytest.raises(PlanError) as err:
        plan_for(overrides)
    assert str(err.value).startswith(message)


def test_a_pvc_model_cannot_run_locally(tmp_path):
    spec = {"model": {"source": {"pvc": {"claimName": "models"}}}}
    with pytest.raises(PlanError, match=r"^model.source.pvc: .*hostPath"):
        plan_for(spec, local_site(tmp_path))
    assert plan_for(spec).role("prefill").command[6] == "/models"  # the claim's root


@pytest.mark.parametrize(
    ("text", "value"),
    [(1024, 1024), ("16Gi", 16 << 30), ("2T", 2 * 10**12), ("512Mi", 512 << 20), ("1.5Gi", 3 << 29), ("100", 100)],
)
def test_quantities(text, value):
    assert quantity_bytes(text, "f") == value


@pytest.mark.parametrize("bad", ["16GB", "lots", "-1", "1e9", ""])
def test_bad_quantities_name_the_field(bad):
    with pytest.raises(ValueError, match=r"^store.cacheSize: "):
        quantity_bytes(bad, "store.cacheSize")


CPU = {"resources": {"gpus": 0}}


def test_sparse_attention_reaches_the_decode_engines_only():
    plan = plan_for(
        {"sparse": {"algorithm": "kvstar", "kvstar": {"sparseRatio": 0.2, "retrievalStride": 8}}, "decode": CPU}
    )
    decode, prefill = plan.role("decode"), plan.role("prefill")
    assert decode.files == [KV_DECODE_CONFIG_FILE] and prefill.files == [KV_CONFIG_FILE]
    assert decode.command[3].endswith(KV_DECODE_CONFIG_FILE) and prefill.command[3].endswith(KV_CONFIG_FILE)
    extra = json.loads(plan.files[KV_DECODE_CONFIG_FILE])["kv_connector_extra_config"]
    assert parse_connector_config(extra).sparse.options.retrieval_stride == 8  # what the engine will run
    assert "sparse" not in kv(plan)
    assert KV_DECODE_CONFIG_FILE not in plan_for({}).files


def test_with_blend_every_request_goes_through_prefill_unless_the_user_says():
    """Blend runs on prefill; a prompt the proxy sent straight to decode (short, or its prefix stored)
    would be computed in full there."""

    def disaggregation(spec: dict) -> dict:
        return yaml.safe_load(plan_for(spec).files[PROXY_CONFIG_FILE]).get("disaggregation", {})

    assert disaggregation({"blend": {}, "prefill": CPU}) == {"min_prefill_tokens": 0}
    assert disaggregation({}) == {}
    mine = {"proxy": {"config": {"disaggregation": {"min_prefill_tokens": 64, "balance_gap": 0}}}}
    assert disaggregation({"blend": {}, "prefill": CPU, **mine}) == {"min_prefill_tokens": 64, "balance_gap": 0}


def test_blend_reaches_the_prefill_engines_only():
    plan = plan_for({"blend": {"recomputeRatio": 0.2}, "prefill": CPU})
    assert "blend" not in kv(plan_for({}))
    assert parse_connector_config(kv(plan)).blend.recompute_ratio == 0.2
    decode = json.loads(plan.files[KV_DECODE_CONFIG_FILE])["kv_connector_extra_config"]
    assert "blend" not in decode
    assert plan.role("decode").command[3].endswith(KV_DECODE_CONFIG_FILE)


@pytest.mark.parametrize(
    ("field", "value", "pool"), [("sparse", {"algorithm": "gsa"}, "decode"), ("blend", {}, "prefill")]
)
def test_sparse_and_blend_need_cpu_engines_in_a_cluster(tmp_path, field, value, pool):
    """They run inside vLLM's CPU attention backend: on a GPU pod sparse would do nothing, Blend would
    stop the engine at start. Locally the engines are this machine's vLLM, whatever the spec's GPUs."""
    with pytest.raises(
        PlanError, match=rf"^{field}: runs on CPU engines only .*{pool}.resources.gpus is 1: set it to 0"
    ):
        plan_for({field: value})
    plan_for({field: value, pool: CPU})
    plan_for({field: value}, local_site(tmp_path))


@pytest.mark.parametrize("arg", ["--enforce-eager", "--enforce_eager"])
def test_an_eager_pipeline_on_cpu_engines_is_refused(tmp_path, arg):
    """vLLM 0.32's CPU build dies on the first request of an eager pipeline-parallel engine
    (tests/connector/test_pipeline.py says why): refused where the engines are the CPU build (every
    engine locally, a pool without GPUs in a cluster), naming the argument that wins."""
    model = {**BASE["model"], "extraArgs": ["--max-num-seqs", "8", arg]}
    cpu, gpu = {"parallel": {"pipeline": 2}, **CPU}, {"parallel": {"pipeline": 2}, "resources": {"gpus": 2}}
    refused = rf"{arg}: vLLM's CPU build cannot run pipeline parallelism eagerly"
    with pytest.raises(PlanError, match=rf"^model.extraArgs\[2\]: {refused} \(prefill.parallel.pipeline is 2"):
        plan_for({"model": model, "prefill": cpu, "decode": cpu}, local_site(tmp_path))
    with pytest.raises(PlanError, match=rf"^model.extraArgs\[2\]: {refused} \(decode.parallel.pipeline is 2"):
        plan_for({"model": model, "prefill": gpu, "decode": cpu})
    with pytest.raises(PlanError, match=rf"^decode.extraArgs\[1\]: {refused}"):
        plan_for({"prefill": gpu, "decode": {**cpu, "extraArgs": ["--no-enforce-eager", arg]}})
    plan_for({"model": model, "prefill": gpu, "decode": gpu})  # CUDA vLLM has no such limit
    for off in ("--no-enforce-eager", "--no_enforce_eager"):
        plan_for({"model": model, "prefill": gpu, "decode": {**cpu, "extraArgs": [off]}})
    plan_for({"model": model}, local_site(tmp_path))  # no pipeline


def engine_dtypes(plan) -> list[str]:
    engines = [r for r in plan.roles if r.component in ("prefill", "decode")]
    return [r.command[r.command.index("--dtype") + 1] for r in engines]


def test_dtype_auto_runs_float32_locally_on_a_cpu_without_bfloat16(tmp_path):
    """vLLM's auto is bfloat16 on CPUs, which run it ~100x slower without AVX512-BF16/AMX (ucm.cpu):
    ucm up, whose engines run on this machine, gives them float32 there; a dtype the user chose stays,
    and a cluster's nodes are not this machine."""
    without = dataclasses.replace(local_site(tmp_path), native_bfloat16=False)
    assert engine_dtypes(plan_for({}, without)) == ["float32", "float32"]
    assert engine_dtypes(plan_for({}, local_site(tmp_path))) == ["auto", "auto"]
    chosen = {"model": {**BASE["model"], "dtype": "bfloat16"}}
    assert engine_dtypes(plan_for(chosen, without)) == ["bfloat16", "bfloat16"]
    assert engine_dtypes(plan_for({}, dataclasses.replace(K8S, native_bfloat16=False))) == ["auto", "auto"]
    extra = {"decode": {"extraArgs": ["--dtype=bfloat16"]}}  # comes after, and wins: nothing to change
    assert engine_dtypes(plan_for(extra, without)) == ["auto", "auto"]


@pytest.mark.parametrize("arg", ["--hf-overrides", "--hf_overrides={}"])
def test_blend_refuses_the_model_overrides_it_sets(tmp_path, arg):
    """ucm serve gives blending engines --hf-overrides (UCM's Blend model class) and refuses one of
    the spec's; render and the operator say so instead of prefill pods failing at start."""
    for field in ("model", "prefill"):
        spec = {"blend": {}, "prefill": CPU}
        spec[field] = {**spec.get(field, {}), "extraArgs": ["--max-num-seqs", "8", arg, '{"a": 1}']}
        if field == "model":
            spec["model"] = {**BASE["model"], **spec["model"]}
        with pytest.raises(
            PlanError, match=rf"^{field}.extraArgs\[2\]: {arg.partition('=')[0]}: set by the deployment"
        ):
            plan_for(spec)
        plan_for({k: v for k, v in spec.items() if k != "blend"})  # without blend it is the user's


def test_pools_of_different_tp_keep_blocks_in_the_larger_tps_shares():
    cpu = {"resources": {"gpus": 0}}
    plan = plan_for({"prefill": {"parallel": {"tensor": 2}, **cpu}, "decode": {"parallel": {"tensor": 1}, **cpu}})
    assert kv(plan)["store_tp"] == 2  # every engine of both pools reads this file
    assert plan.role("decode").files == [KV_CONFIG_FILE] and plan.role("prefill").files == [KV_CONFIG_FILE]
    assert "store_tp" not in kv(
        plan_for({"prefill": {"parallel": {"tensor": 2}, **cpu}, "decode": {"parallel": {"tensor": 2}, **cpu}})
    )
    with pytest.raises(ValueError, match=r"blend: needs prefill and decode split alike"):
        UCMDeploymentSpec.model_validate({**BASE, "blend": {}, "decode": {"parallel": {"tensor": 2}, **cpu}})


def test_blend_is_refused_for_engines_split_over_ranks():
    parallel = {"parallel": {"tensor": 2}, "resources": {"gpus": 0}}
    with pytest.raises(ValueError, match=r"blend: .*tensor and pipeline"):
        UCMDeploymentSpec.model_validate({**BASE, "blend": {}, "prefill": parallel, "decode": parallel})


def test_offload_is_refused_for_decode_engines_split_into_pipeline_stages():
    sparse = {"algorithm": "esa", "offloadBlocks": 4096}
    stages = {"parallel": {"pipeline": 2}, "resources": {"gpus": 0}}
    with pytest.raises(ValueError, match=r"sparse.offloadBlocks: decode engines split into pipeline stages \(2\)"):
        UCMDeploymentSpec.model_validate({**BASE, "sparse": sparse, "prefill": stages, "decode": stages})
    # Tensor-parallel decode engines off-load: each rank moves its KV heads; their connector is told.
    plan = plan_for({"sparse": sparse, "decode": {"parallel": {"tensor": 2}, "resources": {"gpus": 0}}})
    assert (
        json.loads(plan.files[KV_DECODE_CONFIG_FILE])["kv_connector_extra_config"]["sparse"]["offload_blocks"] == 4096
    )


def test_an_open_proxy_outside_the_cluster_is_an_explicit_choice():
    plan_for({"proxy": {"service": {"type": "NodePort"}, "allowAnonymous": True}})
    plan_for({"proxy": {"service": {"type": "LoadBalancer"}, "apiKeySecret": {"name": "keys"}}})


def test_engines_drain_for_their_pools_timeout_within_the_pods_grace_period(tmp_path):
    from ucm.deploy.kubernetes import Owner, render
    from ucm.deploy.local import LocalStack

    overrides = {"decode": {"drainTimeoutS": 900}}
    spec = UCMDeploymentSpec.model_validate({**BASE, **overrides})
    plan = plan_for(overrides)
    grace = {}
    for obj in render(Owner("demo", "serving", None), spec, plan):
        if obj["kind"] == "Deployment":
            pod = obj["spec"]["template"]["spec"]
            grace[obj["metadata"]["name"]] = (pod["terminationGracePeriodSeconds"], pod["containers"][0]["command"])
    seconds, command = grace["demo-decode"]
    assert command[command.index("--shutdown-timeout") + 1] == "900"
    assert seconds >= 900 + plan.role("decode").drain_delay_s  # never killed mid-drain
    seconds, command = grace["demo-prefill"]
    assert command[command.index("--shutdown-timeout") + 1] == "300"  # long enough for a long generation
    assert seconds >= 300 + plan.role("prefill").drain_delay_s
    # `ucm up` waits as long before its SIGKILL.
    local = {**BASE, "model": {"source": {"hostPath": str(tmp_path)}}, **overrides}
    stack = LocalStack(UCMDeploymentSpec.model_validate(local), tmp_path / "run")
    assert next(p for p in stack.processes if p.role.component == "decode").role.drain_timeout_s == 900


@pytest.mark.parametrize("bad", [-1, 3601])
def test_a_drain_timeout_out_of_bounds_names_the_field(bad):
    with pytest.raises(ValueError, match="drainTimeoutS"):
        UCMDeploymentSpec.model_validate({**BASE, "prefill": {"drainTimeoutS": bad}})


def test_engine_pools_roll_without_losing_capacity_unless_told():
    from ucm.deploy.kubernetes import Owner, render

    overrides = {"decode": {"rollout": {"maxSurge": 2, "maxUnavailable": 1}}}
    spec = UCMDeploymentSpec.model_validate({**BASE, **overrides})
    strategies = {
        obj["metadata"]["name"]: obj["spec"].get("strategy")
        for obj in render(Owner("demo", "serving", None), spec, plan_for(overrides))
        if obj["kind"] == "Deployment"
    }
    rolling = {name: (s or {}).get("rollingUpdate") for name, s in strategies.items()}
    assert rolling["demo-prefill"] == {"maxSurge": 1, "maxUnavailable": 0}  # the default keeps capacity
    assert rolling["demo-decode"] == {"maxSurge": 2, "maxUnavailable": 1}
    assert strategies["demo-proxy"] is None  # Kubernetes' default


def test_named_scrapers_reach_the_engines_metrics_and_nobody_else_does():
    from ucm.deploy.kubernetes import Owner, render

    prometheus = {"namespaceSelector": {"kubernetes.io/metadata.name": "monitoring"}, "podSelector": {"app": "prom"}}
    overrides = {"monitoring": {"scrapers": [prometheus]}}
    spec = UCMDeploymentSpec.model_validate({**BASE, **overrides})
    policy = next(
        o
        for o in render(Owner("demo", "serving", None), spec, plan_for(overrides))
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "demo-engines"
    )
    api, events, engines = policy["spec"]["ingress"]
    assert api["ports"] == [{"port": "http", "protocol": "TCP"}]
    # Prefill's KV events carry prompts' tokens: the proxy alone may subscribe.
    assert events == {
        "from": [api["from"][0]],
        "ports": [{"port": "kv-events", "protocol": "TCP"}, {"port": "kv-replay", "protocol": "TCP"}],
    }
    assert api["from"][1] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app": "prom"}},
    }
    assert "ports" not in engines and len(api["from"]) == 2  # the proxy and the scraper, nothing else


def test_file_store_tuning_and_connector_timing_reach_every_engine(tmp_path):
    files = {"capacity": "10Gi", "ioThreads": 16, "directIO": True, "fsync": True, "verifyChecksum": False}
    connector = {"loadMode": "step", "pdWaitTimeoutS": 5, "pdSaveWaitS": 0, "hugePages": False}
    overrides = {"store": {**BASE["store"], "files": files}, "connector": connector}
    for site in (K8S, local_site(tmp_path)):  # the operator and `ucm up` alike
        extra = kv(plan_for(overrides, site))
        assert extra["store"]["posix"] == {
            "roots": [site.kv_dir],
            "capacity": 10 << 30,
            "io_threads": 16,
            "direct_io": True,
            "fsync": True,
            "verify_checksum": False,
        }
        assert (extra["load_mode"], extra["pd_wait_timeout_s"], extra["pd_save_wait_s"]) == ("step", 5, 0)
        assert extra["huge_pages"] is False
        assert "save_mode" not in extra  # unset: the connector's default


def test_a_claim_the_deployment_creates_gets_a_capacity_by_default():
    created = {"type": "posix", "pvc": {"create": {"size": "100Gi"}}}
    assert kv(plan_for({"store": created}))["store"]["posix"]["capacity"] == int(100 * (1 << 30) * 0.9)
    assert "capacity" not in kv(plan_for({}))["store"]["posix"]  # an existing claim: its size is unknown
    explicit = {**created, "files": {"capacity": "1Ti"}}
    assert kv(plan_for({"store": explicit}))["store"]["posix"]["capacity"] == 1 << 40


def test_mooncake_over_rdma_names_its_device():
    store = {"type": "mooncake", "mooncake": {"master": {}, "protocol": "rdma", "deviceName": "mlx5_0"}}
    mooncake = kv(plan_for({"store": store}))["store"]["mooncake"]
    assert (mooncake["protocol"], mooncake["device_name"]) == ("rdma", "mlx5_0")


def engine_events(role) -> dict | None:
    command = role.command
    return json.loads(command[command.index("--kv-events-config") + 1]) if "--kv-events-config" in command else None


def test_prefill_engines_publish_their_kv_events_where_the_proxy_follows_them(tmp_path):
    plan = plan_for({})
    events = engine_events(plan.role("prefill"))
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",  # vLLM binds a wildcard endpoint (it would connect to any other)
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv-events",
    }
    assert [p.name for p in plan.role("prefill").ports] == ["http", "kv-events", "kv-replay"]
    assert engine_events(plan.role("decode")) is None  # decode is chosen by load, not by what it holds
    proxy = ProxyConfig.model_validate(yaml.safe_load(plan.files[PROXY_CONFIG_FILE]))
    assert proxy.routing.prefill == "kv_aware"
    assert proxy.routing.kv_events.endpoint("http://10.1.2.3:8000").replay == "tcp://10.1.2.3:5558"

    local = plan_for({"prefill": {"replicas": 2}}, local_site(tmp_path))
    (tmp_path / BACKENDS_FILE).write_text(local.files[BACKENDS_FILE])
    proxy = ProxyConfig.model_validate(yaml.safe_load(local.files[PROXY_CONFIG_FILE]))
    for role in (local.role("prefill-0"), local.role("prefill-1")):
        url = f"http://127.0.0.1:{role.ports[0].number}"
        followed = proxy.routing.kv_events.endpoint(url)
        published = engine_events(role)
        assert (followed.events, followed.replay) == (published["endpoint"], published["replay_endpoint"])
        assert published["endpoint"].startswith("ipc://@")  # not reachable from other machines


def test_kv_events_off_leaves_engines_and_proxy_as_before():
    plan = plan_for({"proxy": {"kvEvents": False}})
    assert engine_events(plan.role("prefill")) is None
    assert [p.name for p in plan.role("prefill").ports] == ["http"]
    proxy = ProxyConfig.model_validate(yaml.safe_load(plan.files[PROXY_CONFIG_FILE]))
    assert proxy.routing.kv_events is None and proxy.routing.prefill == "prefix_affinity"


def test_the_deployment_decides_where_events_go():
    with pytest.raises(PlanError, match=r"proxy\.config\.routing\.kv_events: set by the deployment"):
        plan_for({"proxy": {"config": {"routing": {"kv_events": {"port": 1}}}}})
    plan = plan_for({"proxy": {"config": {"routing": {"prefill": "least_outstanding"}}}})
    proxy = ProxyConfig.model_validate(yaml.safe_load(plan.files[PROXY_CONFIG_FILE]))
    assert proxy.routing.prefill == "least_outstanding"  # the user's choice stands


MULTI_NODE = {
    "prefill": {"parallel": {"tensor": 8, "pipeline": 2, "nodes": 2}, "resources": {"gpus": 8}},
    "decode": {
        "replicas": 3,
        "parallel": {"tensor": 8, "pipeline": 2, "nodes": 4, "topologyKey": "topology.kubernetes.io/zone"},
        "resources": {"gpus": 4},
        "autoscaling": {"maxReplicas": 6},
    },
}


def test_one_node_per_engine_runs_as_before_with_the_split_from_parallel():
    plan = plan_for(
        {
            "prefill": {"parallel": {"tensor": 2}, "resources": {"gpus": 2}},
            "decode": {"parallel": {"tensor": 2}, "resources": {"gpus": 2}},
        }
    )
    for role in plan.roles[:2]:
        assert role.group is None
        assert role.command[role.command.index("--tensor-parallel-size") + 1] == "2"
        assert not {"--pipeline-parallel-size", "--nnodes", "--node-rank", "--master-addr", "--headless"} & set(
            role.command
        )


def test_a_multi_node_engine_is_a_group_whose_leader_serves_and_whose_workers_join_it():
    plan = plan_for(MULTI_NODE)
    prefill, decode = plan.role("prefill"), plan.role("decode")
    assert (prefill.group.size, decode.group.size) == (2, 4)
    assert decode.group.topology_key == "topology.kubernetes.io/zone" and prefill.group.topology_key is None

    def option(command, name):
        return command[command.index(name) + 1]

    leader, worker = decode.command, decode.group.worker_command
    for command in (leader, worker):
        assert option(command, "--tensor-parallel-size") == "8" and option(command, "--pipeline-parallel-size") == "2"
        assert option(command, "--nnodes") == "4" and option(command, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
    assert option(leader, "--node-rank") == "0" and "--headless" not in leader
    assert option(worker, "--node-rank") == "$(LWS_WORKER_INDEX)" and worker[-1] == "--headless"
    # The same engine otherwise: model, store config, port.
    assert worker[: worker.index("--nnodes")] == leader[: leader.index("--nnodes")]


def test_a_multi_node_engine_runs_locally_as_processes_on_loopback(tmp_path):
    """The same group: the leader's address is this machine (each start picks a rendezvous port)."""
    plan = plan_for(
        {
            "prefill": {"parallel": {"tensor": 2}, "resources": {"gpus": 0}},
            "decode": {"parallel": {"tensor": 2, "nodes": 2}, "resources": {"gpus": 0}},
        },
        local_site(tmp_path),
    )
    decode = plan.role("decode-0")
    assert decode.group is not None and decode.group.size == 2
    for command in (decode.command, decode.group.worker_command):
        assert command[command.index("--master-addr") + 1] == "127.0.0.1"
        assert "--master-port" not in command
    assert decode.group.worker_command[-3:] == ["--node-rank", "$(LWS_WORKER_INDEX)", "--headless"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prefill": {"parallel": {"tensor": 3, "nodes": 2}, "resources": {"gpus": 0}}}, "parallel.nodes: must divide"),
        (
            {"decode": {"parallel": {"tensor": 4, "nodes": 2}}},
            "resources.gpus: one per rank a pod runs (tensor x pipeline / nodes = 2), or 0 for CPU engines; got 1",
        ),
        (
            {
                "decode": {"parallel": {"tensor": 3}, "resources": {"gpus": 3}},
                "prefill": {"parallel": {"tensor": 2}, "resources": {"gpus": 2}},
            },
            "only tensor differs, with pipeline 1 and the larger tensor a multiple of the smaller (the store then "
            "keeps each block in shares of the larger); got prefill 2 x 1, decode 3 x 1",
        ),
        (
            {"decode": {"parallel": {"tensor": 2, "pipeline": 2}, "resources": {"gpus": 4}}},
            "got prefill 1 x 1, decode 2 x 2",
        ),
        ({"decode": {"parallel": {"nodes": 0}}}, "greater than or equal to 1"),
    ],
)
def test_a_split_that_cannot_work_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        UCMDeploymentSpec.model_validate({**BASE, **overrides})


def test_multi_node_pools_render_as_leader_worker_sets():
    from ucm.deploy.autoscaling import Autoscaler
    from ucm.deploy.kubernetes import Owner, render

    spec = UCMDeploymentSpec.model_validate({**BASE, **MULTI_NODE})
    for provider in ("keda", "hpa"):
        objects = {
            (o["kind"], o["metadata"]["name"]): o
            for o in render(Owner("demo", "serving", "u"), spec, plan_for(MULTI_NODE), Autoscaler(provider=provider))
        }
        assert ("Deployment", "demo-decode") not in objects and ("Deployment", "demo-proxy") in objects
        lws = objects[("LeaderWorkerSet", "demo-decode-group")]["spec"]
        assert "replicas" not in lws  # autoscaled: the autoscaler's count
        assert objects[("LeaderWorkerSet", "demo-prefill-group")]["spec"]["replicas"] == 1
        template = lws["leaderWorkerTemplate"]
        assert template["size"] == 4 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
        assert lws["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 1, "maxUnavailable": 0}
        leader = template["leaderTemplate"]["spec"]["containers"][0]
        worker = template["workerTemplate"]["spec"]["containers"][0]
        assert leader["readinessProbe"]["httpGet"]["path"] == "/health" and leader["ports"][0]["name"] == "http"
        assert "readinessProbe" not in worker and worker["ports"] == []
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "4"
        # A worker's ranks serve its leader's requests until the leader's drain is over.
        drain = leader["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert worker["lifecycle"]["preStop"]["sleep"]["seconds"] == drain + spec.decode.drain_timeout_s
        grace = template["workerTemplate"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > worker["lifecycle"]["preStop"]["sleep"]["seconds"]
        (term,) = template["workerTemplate"]["spec"]["affinity"]["podAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["podAffinityTerm"]["topologyKey"] == "topology.kubernetes.io/zone"
        assert term["podAffinityTerm"]["matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
        assert (
            "affinity"
            not in objects[("LeaderWorkerSet", "demo-prefill-group")]["spec"]["leaderWorkerTemplate"]["leaderTemplate"][
                "spec"
            ]
        )
        # The proxy finds leaders only: workers serve no HTTP.
        selector = objects[("Service", "demo-decode")]["spec"]["selector"]
        assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
        scaler = objects[("ScaledObject" if provider == "keda" else "HorizontalPodAutoscaler", "demo-decode")]["spec"]
        assert scaler["scaleTargetRef"] == {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "name": "demo-decode-group",
        }
