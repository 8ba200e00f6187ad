"""``spec.lora``: adapters every engine of both pools serves, rendered alike for Kubernetes and ``ucm up``,
and bounded by the operator's policy (issue 67)."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys

import pytest
from pydantic import ValidationError

from ucm.config import format_validation_error
from ucm.deploy import lora, policy
from ucm.deploy.kubernetes import Owner, render
from ucm.deploy.local import LocalStack, StackError, default_spec
from ucm.deploy.plan import build_plan
from ucm.deploy.policy import Policy
from ucm.deploy.roles import PlanError, Site
from ucm.deploy.spec import UCMDeploymentSpec, read_spec

K8S = Site("kubernetes", namespace="serving")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
BASE = {
    "model": {"source": {"pvc": {"claimName": "models", "path": "/llama"}}, "servedName": "llama"},
    "store": {"type": "posix", "pvc": {"claimName": "kv"}},
}
LORA = {
    "adapters": [
        {"name": "sql", "source": {"pvc": {"claimName": "adapters", "path": "/sql"}}},
        {"name": "chat", "source": {"pvc": {"claimName": "adapters", "path": "chat/"}}},
        {"name": "legal", "source": {"pvc": {"claimName": "models", "path": "/lora/legal"}}},
        {"name": "org/tone", "source": {"hostPath": "/data/adapters/tone"}},
        {"name": "hub", "source": {"hf": "org/hub-adapter", "revision": COMMIT}},
    ],
    "maxAdapters": 2,
    "maxRank": 64,
    "maxCpuAdapters": 5,
}


def spec_with(lora_: dict | None = None, **overrides) -> UCMDeploymentSpec:
    return read_spec({**BASE, "lora": LORA if lora_ is None else lora_, **overrides})


def refusal(spec: dict) -> str:
    with pytest.raises(ValidationError) as exc:
        read_spec({**BASE, **spec})
    return format_validation_error(exc.value, "spec")


def vllm_args(command: list[str]) -> list[str]:
    return command[command.index("--") + 1 :]


def lora_flags(command: list[str]) -> list[str]:
    args = vllm_args(command)
    return args[args.index("--enable-lora") : args.index("--host")]


# Validation: each bound names its field.


@pytest.mark.parametrize(
    ("lora_", "message"),
    [
        (
            {"adapters": [{"name": "bad name", "source": {"hostPath": "/a"}}]},
            "spec.lora.adapters.0.name: 'bad name' is not a served model name (letters, digits and",
        ),
        (
            {"adapters": [{"name": "-x", "source": {"hostPath": "/a"}}]},
            "spec.lora.adapters.0.name: '-x' is not a served model name",
        ),
        (
            {"adapters": [{"name": "a", "source": {"hostPath": "/a"}}, {"name": "a", "source": {"hostPath": "/b"}}]},
            "spec.lora: lora.adapters[1].name: a is also lora.adapters[0]'s; names are unique",
        ),
        (
            {"adapters": [{"name": "a", "source": {"hf": "org/a"}}]},
            "spec.lora.adapters.0.source: lora.adapters.source.revision: required with hf (a commit hash",
        ),
        (
            {"adapters": [{"name": "a", "source": {"hf": "org/a", "revision": "main"}}]},
            "spec.lora.adapters.0.source.revision: 'main' is not a commit hash (40 hexadecimal digits",
        ),
        (
            {"adapters": [{"name": "a", "source": {"hostPath": "/a", "revision": COMMIT}}]},
            "spec.lora.adapters.0.source: lora.adapters.source.revision: only with hf",
        ),
        (
            {"adapters": [{"name": "a", "source": {}}]},
            "spec.lora.adapters.0.source: lora.adapters.source: exactly one of pvc, hostPath, hf must be set",
        ),
        (
            {"adapters": [{"name": "a", "source": {"hostPath": "adapters/a"}}]},
            "spec.lora.adapters.0.source.hostPath: an absolute path is needed",
        ),
        ({"maxAdapters": 0}, "spec.lora.maxAdapters: Input should be greater than or equal to 1"),
        ({"maxRank": 12}, "spec.lora.maxRank: Input should be 1, 8, 16, 32, 64, 128, 256, 320 or 512"),
        ({"maxCpuAdapters": 2}, "spec.lora: lora.maxCpuAdapters: must be at least maxAdapters (2 < 4)"),
        ({"adapters": [{"name": f"a{i}", "source": {"hostPath": "/a"}} for i in range(65)]}, "spec.lora.adapters:"),
    ],
)
def test_a_bad_lora_section_names_the_field(lora_, message):
    assert refusal({"lora": lora_}).startswith(message), refusal({"lora": lora_})


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ({"source": {"hf": "org/base"}, "servedName": "base"}, "base"),
        ({"source": {"hf": "org/base"}}, "org/base"),  # served under its source when unnamed
    ],
)
def test_an_adapter_may_not_take_the_base_models_name(model, name):
    message = refusal({"model": model, "lora": {"adapters": [{"name": name, "source": {"hostPath": "/a"}}]}})
    assert message.startswith(f"spec: lora.adapters[0].name: {name} is the base model's served name"), message


def test_defaults():
    s = spec_with({"adapters": [{"name": "a", "source": {"hostPath": "/a"}}]})
    assert s.lora is not None
    assert (s.lora.max_adapters, s.lora.max_rank, s.lora.max_cpu_adapters) == (4, 16, None)
    assert s.lora.adapters[0].source.pvc is None
    assert read_spec(BASE).lora is None


# Rendering: both pools alike, every source a directory in the container.


def test_both_pools_get_the_same_flags_and_mounts():
    plan = build_plan("demo", spec_with(), K8S)
    prefill, decode = plan.role("prefill"), plan.role("decode")
    assert (
        lora_flags(prefill.command)
        == lora_flags(decode.command)
        == [
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "64",
            "--max-cpu-loras",
            "5",
            "--lora-modules",
            '{"name":"sql","path":"/adapters/pvc/adapters/sql"}',
            '{"name":"chat","path":"/adapters/pvc/adapters/chat"}',
            # On the model's claim: read where the model's volume has it, not mounted twice.
            '{"name":"legal","path":"/models/lora/legal"}',
            '{"name":"org/tone","path":"/adapters/node/3"}',
            f'{{"name":"hub","path":"/adapters/hub/org--hub-adapter--{COMMIT}"}}',
        ]
    )
    assert prefill.volumes == decode.volumes
    assert prefill.steps == decode.steps
    mounts = {v.name: (v.mount_path, v.source, v.read_only) for v in prefill.volumes}
    claim = {"persistentVolumeClaim": {"claimName": "adapters"}}
    assert mounts["lora-pvc-0"] == ("/adapters/pvc/adapters", claim, True)
    assert mounts["lora-node-3"] == (
        "/adapters/node/3",
        {"hostPath": {"path": "/data/adapters/tone", "type": "Directory"}},
        True,
    )
    assert mounts["lora-hub"] == ("/adapters/hub", {"emptyDir": {}}, True)
    assert [v.source.get("persistentVolumeClaim", {}).get("claimName") for v in prefill.volumes].count("models") == 1
    (step,) = prefill.steps
    hub_dir = f"/adapters/hub/org--hub-adapter--{COMMIT}"
    assert step.command == ["python3", "-m", "ucm.deploy.lora", "org/hub-adapter", COMMIT, hub_dir]


def test_vllm_reads_the_flags_as_the_adapters_given():
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.openai.models.protocol import LoRAModulePath
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    command = build_plan("demo", spec_with(), K8S).role("prefill").command
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_args(command))
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 2, 64, 5)
    assert [(m.name, m.path) for m in args.lora_modules] == [
        ("sql", "/adapters/pvc/adapters/sql"),
        ("chat", "/adapters/pvc/adapters/chat"),
        ("legal", "/models/lora/legal"),
        ("org/tone", "/adapters/node/3"),
        ("hub", f"/adapters/hub/org--hub-adapter--{COMMIT}"),
    ]
    assert all(isinstance(m, LoRAModulePath) for m in args.lora_modules)
    assert args.port == 8000  # the options after the modules are read as options


def test_engine_pods_mount_the_adapters_and_download_hub_ones_first():
    s = spec_with(
        prefill={"resources": {"gpus": 1, "requests": {"cpu": "4"}, "limits": {"memory": "32Gi"}}},
        decode={"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]},
    )
    objects = render(Owner("demo", "serving", None), s, build_plan("demo", s, K8S))
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"}
    for name in ("demo-prefill", "demo-decode"):
        pod = pods[name]
        (engine,) = pod["containers"]
        (init,) = pod["initContainers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["lora-hub"] == {"name": "lora-hub", "emptyDir": {}}
        assert volumes["lora-pvc-0"]["persistentVolumeClaim"] == {"claimName": "adapters"}
        engine_mounts = {m["name"]: m for m in engine["volumeMounts"]}
        assert all(engine_mounts[v]["readOnly"] for v in ("lora-hub", "lora-pvc-0", "lora-node-3"))
        # The download writes where the engine then reads, with the engine's image and environment.
        assert init["volumeMounts"] == [{"name": "lora-hub", "mountPath": "/adapters/hub"}]
        assert init["command"][:3] == ["python3", "-m", "ucm.deploy.lora"]
        assert (init["image"], init["env"], init["securityContext"]) == (
            engine["image"],
            engine["env"],
            engine["securityContext"],
        )
    # A download needs no GPU; the engine's other requests and limits stay (a quota may need them).
    prefill_init = pods["demo-prefill"]["initContainers"][0]
    assert prefill_init["resources"] == {"requests": {"cpu": "4"}, "limits": {"memory": "32Gi"}}
    assert pods["demo-prefill"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in (
        pods["demo-decode"]["initContainers"][0]["env"]
    )


def test_multi_node_engines_give_their_workers_the_adapters_too():
    s = spec_with(decode={"parallel": {"tensor": 2, "nodes": 2}})
    objects = render(Owner("demo", "serving", None), s, build_plan("demo", s, K8S))
    (group,) = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    template = group["spec"]["leaderWorkerTemplate"]
    for pod in (template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]):
        assert [c["name"] for c in pod["initContainers"]] == ["adapter-0"]
        assert "lora-pvc-0" in {v["name"] for v in pod["volumes"]}
    worker = template["workerTemplate"]["spec"]["containers"][0]["command"]
    assert lora_flags(worker) == lora_flags(build_plan("demo", s, K8S).role("prefill").command)


def test_without_lora_nothing_changes():
    plan = build_plan("demo", read_spec(BASE), K8S)
    for role in plan.roles:
        assert not role.steps
        assert not any(a.startswith("--enable-lora") or a == "--lora-modules" for a in role.command)
        assert not any(v.name.startswith("lora-") for v in role.volumes)


def test_an_adapters_list_may_be_empty():
    flags = lora_flags(build_plan("demo", spec_with({}), K8S).role("decode").command)
    assert flags == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]


@pytest.mark.parametrize(
    ("field", "args", "index", "flag"),
    [
        ("model", ["--lora-modules", "x=/models/x"], 0, "--lora-modules"),
        ("model", ["--enable_lora"], 0, "--enable-lora"),
        ("prefill", ["--max-num-seqs", "8", "--max-loras=8"], 2, "--max-loras"),
        ("decode", ["--max-lora-r", "64"], 0, "--max-lora-rank"),  # an abbreviation vLLM completes
        ("decode", ["--max-cpu-loras", "8"], 0, "--max-cpu-loras"),
        ("decode", ["--no-enable-lora"], 0, "--enable-lora"),
        ("prefill", ['--default-mm-loras={"audio":"/models/a"}'], 0, "--default-mm-loras"),
    ],
)
def test_lora_flags_in_extra_args_are_refused_for_spec_lora(field, args, index, flag):
    model = {"source": {"hostPath": "/models/llama"}}  # one that runs locally too
    overrides = (
        {"model": {**model, "extraArgs": args}} if field == "model" else {"model": model, field: {"extraArgs": args}}
    )
    for with_lora in (None, {"adapters": []}):
        spec = read_spec({**BASE, **overrides, **({"lora": with_lora} if with_lora is not None else {})})
        for site in (K8S, Site("local")):
            with pytest.raises(PlanError) as err:
                build_plan("demo", spec, site)
            assert str(err.value).startswith(f"{field}.extraArgs[{index}]: {flag}: set spec.lora"), str(err.value)


def test_lora_tuning_stays_open_in_extra_args():
    s = spec_with(model={**BASE["model"], "extraArgs": ["--lora-dtype", "bfloat16", "--fully-sharded-loras"]})
    plan = build_plan("demo", s, K8S)
    assert lora_flags(plan.role("prefill").command) == lora_flags(plan.role("decode").command)
    assert "--lora-dtype" in plan.role("decode").command


# `ucm up`: the same flags, with this machine's paths.


def adapter_dir(path) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    return str(path)


def test_ucm_up_serves_local_and_hub_adapters_alike_in_both_pools(tmp_path):
    tone = adapter_dir(tmp_path / "tone")
    lora_ = {
        "adapters": [
            {"name": "tone", "source": {"hostPath": tone}},
            {"name": "hub", "source": {"hf": "org/hub-adapter", "revision": COMMIT}},
        ]
    }
    spec = UCMDeploymentSpec.model_validate({**default_spec(tmp_path), "lora": lora_})
    stack = LocalStack(spec, tmp_path / "run")
    engines = [p.role for p in stack.processes if p.role.component in ("prefill", "decode")]
    hub_dir = str(tmp_path / "run" / "adapters" / "hub" / f"org--hub-adapter--{COMMIT}")
    assert {json.dumps(lora_flags(r.command)) for r in engines} == {
        json.dumps(
            [
                "--enable-lora",
                "--max-loras",
                "4",
                "--max-lora-rank",
                "16",
                "--lora-modules",
                json.dumps({"name": "tone", "path": tone}, separators=(",", ":")),
                json.dumps({"name": "hub", "path": hub_dir}, separators=(",", ":")),
            ]
        )
    }
    assert all(not r.volumes for r in engines)


def fake_python(tmp_path, monkeypatch, exit_code: int = 0):
    """``python3`` for the stack's steps: records its arguments, says something, exits ``exit_code``."""
    calls = tmp_path / "calls"
    script = tmp_path / "python3"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "no such revision" >&2\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr("ucm.deploy.local.resolve", lambda exe: str(script) if exe == "python3" else exe)
    return calls


def hub_stack(tmp_path) -> LocalStack:
    lora_ = {"adapters": [{"name": "hub", "source": {"hf": "org/hub-adapter", "revision": COMMIT}}]}
    spec = UCMDeploymentSpec.model_validate({**default_spec(tmp_path), "decode": {"replicas": 2}, "lora": lora_})
    stack = LocalStack(spec, tmp_path / "run")
    stack.logs.mkdir(parents=True)
    return stack


def test_ucm_up_downloads_a_hub_adapter_once_for_every_engine(tmp_path, monkeypatch):
    calls = fake_python(tmp_path, monkeypatch)
    stack = hub_stack(tmp_path)
    messages: list[str] = []
    stack._prepare(stack.processes, lambda message, _: messages.append(message))
    stack._prepare(stack.processes, lambda message, _: messages.append(message))  # a restart: done already
    hub_dir = tmp_path / "run" / "adapters" / "hub" / f"org--hub-adapter--{COMMIT}"
    assert calls.read_text().splitlines() == [f"-m ucm.deploy.lora org/hub-adapter {COMMIT} {hub_dir}"]
    assert len(messages) == 1 and "prefill-0: adapter-0: python3 -m ucm.deploy.lora org/hub-adapter" in messages[0]


def test_ucm_up_stops_at_a_failed_download_with_its_log(tmp_path, monkeypatch):
    fake_python(tmp_path, monkeypatch, exit_code=3)
    stack = hub_stack(tmp_path)
    with pytest.raises(StackError) as err:
        stack._prepare(stack.processes, lambda *_: None)
    assert str(err.value).startswith("prefill-0: adapter-0 (python3 -m ucm.deploy.lora org/hub-adapter"), str(err.value)
    assert "exited with code 3" in str(err.value) and str(err.value).endswith("no such revision\n")


def test_ucm_up_refuses_what_it_cannot_serve(tmp_path):
    base = default_spec(tmp_path)
    pvc = {"adapters": [{"name": "a", "source": {"pvc": {"claimName": "adapters"}}}]}
    with pytest.raises(PlanError, match=r"^lora.adapters\[0\].source.pvc: a PersistentVolumeClaim exists only"):
        LocalStack(UCMDeploymentSpec.model_validate({**base, "lora": pvc}), tmp_path / "run")
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty"):
        missing = {"adapters": [{"name": "a", "source": {"hostPath": str(path)}}]}
        with pytest.raises(StackError, match=r"^lora.adapters\[0\].source.hostPath: .* \(no adapter_config.json\)$"):
            LocalStack(UCMDeploymentSpec.model_validate({**base, "lora": missing}), tmp_path / "run")


# The download itself (the init container's command).


def test_fetch_downloads_the_pinned_revision_and_checks_it_is_an_adapter(tmp_path, monkeypatch):
    import huggingface_hub

    asked = []

    def snapshot_download(repo_id, revision, local_dir):
        asked.append((repo_id, revision, local_dir))
        os.makedirs(local_dir, exist_ok=True)
        if repo_id == "org/adapter":
            (tmp_path / "out" / "adapter_config.json").write_text("{}")
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert lora.main(["org/adapter", COMMIT, str(tmp_path / "out")]) == 0
    assert asked == [("org/adapter", COMMIT, str(tmp_path / "out"))]
    with pytest.raises(SystemExit, match=r"org/model@\w+: no adapter_config.json; not a LoRA adapter repository"):
        lora.main(["org/model", COMMIT, str(tmp_path / "other")])


def test_the_download_runs_as_the_init_container_runs_it():
    """``python3 -m ucm.deploy.lora`` is a command: its help comes back without a hub."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "ucm.deploy.lora", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "REPO" in done.stdout.upper() and "revision" in done.stdout


# The operator's policy.


def test_an_adapter_on_a_node_path_needs_the_policys_leave():
    s = spec_with({"adapters": [{"name": "a", "source": {"hostPath": "/data/adapters/a"}}]})
    with pytest.raises(PlanError, match=r"^lora.adapters\[0\].source.hostPath: /data/adapters/a is not under an"):
        Policy().check(s, "serving", "demo")
    Policy(host_path_prefixes=("/data/adapters",)).check(s, "serving", "demo")
    escape = spec_with({"adapters": [{"name": "a", "source": {"hostPath": "/data/adapters/../../etc"}}]})
    with pytest.raises(PlanError, match=r"^lora.adapters\[0\].source.hostPath: /data/adapters/../../etc is not"):
        Policy(host_path_prefixes=("/data/adapters",)).check(escape, "serving", "demo")


@pytest.mark.parametrize("variable", sorted(policy.RUNTIME_LORA_ENV))
def test_runtime_adapter_loading_is_refused_unless_allowed_for_the_deployment(variable):
    s = read_spec({**BASE, "decode": {"env": [{"name": "A", "value": "1"}, {"name": variable, "value": "1"}]}})
    for bounds in (Policy(), Policy(runtime_lora=("serving/other", "team-b/demo"))):
        with pytest.raises(PlanError) as err:
            bounds.check(s, "serving", "demo")
        assert str(err.value).startswith(f"decode.env[1].name: {variable} is not allowed: "), str(err.value)
        assert "--allow-runtime-lora serving/demo" in str(err.value)
    Policy(runtime_lora=("serving/demo",)).check(s, "serving", "demo")


@pytest.mark.parametrize("prefix", ["VLLM_ALLOW_RUNTIME", "VLLM_LORA_"])
def test_runtime_adapter_loading_cannot_come_through_env_from(prefix):
    s = read_spec({**BASE, "prefill": {"envFrom": [{"configMapRef": {"name": "c"}, "prefix": prefix}]}})
    with pytest.raises(PlanError, match=r"^prefill.envFrom\[0\].prefix: .* could make VLLM_"):
        Policy().check(s, "serving", "demo")
    Policy(runtime_lora=("serving/demo",)).check(s, "serving", "demo")


def test_the_runtime_lora_flag_takes_deployments_by_name():
    parser = argparse.ArgumentParser()
    policy.add_arguments(parser)
    args = parser.parse_args(["--allow-runtime-lora", "serving/chat", "--allow-runtime-lora=b/c.d"])
    assert policy.from_args(args).runtime_lora == ("serving/chat", "b/c.d")
    for bad in ("chat", "Serving/chat", "a/b/c", "/chat"):
        with pytest.raises(SystemExit, match=r"--allow-runtime-lora: .* is not NAMESPACE/NAME"):
            policy.from_args(parser.parse_args(["--allow-runtime-lora", bad]))
    # Not a variable allowed everywhere: per deployment.
    with pytest.raises(SystemExit, match="--allow-env: VLLM_ALLOW_RUNTIME_LORA_UPDATING is allowed per deployment"):
        policy.from_args(parser.parse_args(["--allow-env", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"]))
