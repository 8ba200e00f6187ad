"""``ucm render`` (the operator's checks) against a spec that writes a refused vLLM option the way
vLLM's parser would still read it, or sets an environment variable that makes the engine load code:
each is refused naming the field (issue 34, H2)."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest

from tests.deploy.test_render_cmd import RESOURCE, render


def with_spec(**pools: Any) -> dict[str, Any]:
    resource = copy.deepcopy(RESOURCE)
    resource["spec"].update(pools)
    return resource


def refused(tmp_path, capsys, resource: dict[str, Any], *flags: str) -> str:
    code, _, err = render(tmp_path, resource, *flags, capsys=capsys)
    assert code == 2, "rendered"
    return err


BYPASSES = [
    # (pool, extraArgs, the field's index, the option vLLM reads)
    ("decode", ["--trust_remote_code"], 0, "--trust-remote-code"),
    ("decode", ["--trust-remote"], 0, "--trust-remote-code"),  # an abbreviation argparse completes
    ("decode", ["--trust-remote-code.x=1"], 0, "--trust-remote-code"),  # dotted: {"x": 1} becomes a positional
    ("decode", ["--no-trust-remote-code"], 0, "--trust-remote-code"),
    ("decode", ["--max-num-seqs", "8", "--trust-rem"], 2, "--trust-remote-code"),
    ("prefill", ["--kv-transfer-config.kv_connector=Evil"], 0, "--kv-transfer-config"),
    ("prefill", ["--kv_transfer_config.kv_connector", "Evil"], 0, "--kv-transfer-config"),
    ("prefill", ["--kv-transfer.kv_role=kv_both"], 0, "--kv-transfer-config"),
    ("prefill", ["--kv-transfer-config={}"], 0, "--kv-transfer-config"),
    ("decode", ["--middleware", "evil.Middleware"], 0, "--middleware"),
    ("decode", ["--middle=evil.Middleware"], 0, "--middleware"),
    ("decode", ["--api_key=mine"], 0, "--api-key"),
    ("decode", ["--api-k", "mine"], 0, "--api-key"),
    ("decode", ["--host=0.0.0.0"], 0, "--host"),
    ("decode", ["--por", "9000"], 0, "--port"),
    ("decode", ["--tool_parser_plugin=/models/evil.py"], 0, "--tool-parser-plugin"),
    ("decode", ["--reasoning-parser-plug", "/models/evil.py"], 0, "--reasoning-parser-plugin"),
    ("decode", ["--allowed_local_media_path=/"], 0, "--allowed-local-media-path"),
    # Options that name code or a file of options (refused since issue 34).
    ("decode", ["--config", "/models/evil.yaml"], 0, "--config"),
    ("decode", ["-O3", "--worker-cls=evil.Worker"], 1, "--worker-cls"),
    ("decode", ["--worker_extension_cls", "evil.Ext"], 0, "--worker-extension-cls"),
    ("decode", ["--scheduler-cls=evil.Scheduler"], 0, "--scheduler-cls"),
    ("decode", ["--logits-processors", "evil.Processor"], 0, "--logits-processors"),
    ("decode", ["--model-class-overrides.LlamaForCausalLM=evil:Model"], 0, "--model-class-overrides"),
    ("decode", ["--distributed-executor-backend=evil.Executor"], 0, "--distributed-executor-backend"),
    ("decode", ["--ec-transfer-config.ec_connector_module_path=evil"], 0, "--ec-transfer-config"),
    ("decode", ["--ec_manager_config.encoder_cache_manager_cls=evil.M"], 0, "--ec-manager-config"),
    ("decode", ["--log-config-file", "/models/logging.json"], 0, "--log-config-file"),
    ("decode", ["--logging-config.pylogging_config_file=/models/logging.json"], 0, "--logging-config"),
    # How an engine is split: the pods rendered must match (<pool>.parallel).
    ("decode", ["-tp", "2"], 0, "--tensor-parallel-size"),
    ("prefill", ["--pipeline_parallel_size=2"], 0, "--pipeline-parallel-size"),
    ("decode", ["-n", "2"], 0, "--nnodes"),
    ("decode", ["--node-rank", "1"], 0, "--node-rank"),
    ("decode", ["--master-addr=10.0.0.1"], 0, "--master-addr"),
    ("decode", ["--headless"], 0, "--headless"),
]


@pytest.mark.parametrize(("pool", "args", "index", "option"), BYPASSES, ids=[" ".join(b[1]) for b in BYPASSES])
def test_every_spelling_of_a_refused_option_is_refused_naming_the_field(tmp_path, capsys, pool, args, index, option):
    err = refused(tmp_path, capsys, with_spec(**{pool: {"extraArgs": args}}))
    assert f"spec.{pool}.extraArgs[{index}]: {option} is not allowed: " in err, err


def test_model_extra_args_are_read_the_same_way(tmp_path, capsys):
    resource = with_spec(model={"source": {"hf": "Qwen/Qwen3-0.6B"}, "extraArgs": ["--trust_remote_code"]})
    err = refused(tmp_path, capsys, resource)
    assert "spec.model.extraArgs[0]: --trust-remote-code is not allowed: runs code downloaded" in err, err
    assert "(vLLM reads --trust_remote_code as --trust-remote-code)" in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--not-a-vllm-option"], "extraArgs[0]: --not-a-vllm-option is not an option of vLLM 0.32.0's server"),
        (["--max-num-seqs", "8", "--trust"], "extraArgs[2]: --trust is ambiguous to vLLM (--trust-remote-code, "),
        (["--"], "extraArgs[0]: -- ends vLLM's options"),
    ],
)
def test_what_vllm_would_not_read_as_one_known_option_is_refused(tmp_path, capsys, args, message):
    err = refused(tmp_path, capsys, with_spec(decode={"extraArgs": args}))
    assert f"spec.decode.{message}" in err, err


def test_spellings_of_allowed_options_pass(tmp_path, capsys):
    args = [
        "--max_num_seqs=8",
        "--enable-prefix-caching",
        "--no-enable-log-requests",
        "-ep",
        "-O3",
        "--compilation-config.cudagraph_capture_sizes",
        "[1,2]",
        "--max-model",
        "4096",
        "-qfp8",
    ]
    code, docs, err = render(tmp_path, with_spec(decode={"extraArgs": args}), capsys=capsys)
    assert code == 0, err
    decode = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "chat-decode")
    assert decode["spec"]["template"]["spec"]["containers"][0]["command"][-len(args) :] == args  # passed as written


CODE_LOADING_ENV = [
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "LD_AUDIT",
    "GCONV_PATH",
    "PYTHONPATH",
    "PYTHONSTARTUP",
    "PYTHONHOME",
    "PYTHONUSERBASE",
    "PYTHONWARNINGS",
    "PYTHONBREAKPOINT",
    "PATH",
    "BASH_ENV",
    "ENV",
    "BASH_FUNC_ls%%",
    "NODE_OPTIONS",
    "PERL5LIB",
    "PERL5OPT",
    "OPENSSL_CONF",
    "CUDA_INJECTION64_PATH",
    "OMP_TOOL_LIBRARIES",
    "NCCL_NET_PLUGIN",
    "CC",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCH_EXTENSIONS_DIR",
    "HOME",
    "XDG_CACHE_HOME",
    "VLLM_PLUGINS",
    "VLLM_ALLOW_INSECURE_SERIALIZATION",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_NCCL_SO_PATH",
    "VLLM_CACHE_ROOT",
]


@pytest.mark.parametrize("name", CODE_LOADING_ENV)
def test_environment_variables_that_load_code_are_refused_naming_the_field(tmp_path, capsys, name):
    env = [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": name, "value": "/models/evil"}]
    err = refused(tmp_path, capsys, with_spec(decode={"env": env}))
    assert f"spec.decode.env[1].name: {name} is not allowed: " in err, err


def test_a_refused_variable_from_a_secret_is_refused_too(tmp_path, capsys):
    env = [{"name": "PYTHONPATH", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    err = refused(tmp_path, capsys, with_spec(prefill={"env": env}))
    assert "spec.prefill.env[0].name: PYTHONPATH is not allowed: " in err, err


def test_the_operator_allows_variables_by_name(tmp_path, capsys):
    env = [{"name": "LD_PRELOAD", "value": "/usr/lib/libjemalloc.so.2"}, {"name": "HF_TOKEN", "value": "x"}]
    code, docs, err = render(tmp_path, with_spec(decode={"env": env}), "--allow-env", "LD_PRELOAD", capsys=capsys)
    assert code == 0, err
    decode = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "chat-decode")
    assert {"name": "LD_PRELOAD", "value": "/usr/lib/libjemalloc.so.2"} in decode["spec"]["template"]["spec"][
        "containers"
    ][0]["env"]
    others = [*env, {"name": "LD_AUDIT", "value": "/x.so"}]  # allowing one name allows only that one
    err = refused(tmp_path, capsys, with_spec(decode={"env": others}), "--allow-env", "LD_PRELOAD")
    assert "spec.decode.env[2].name: LD_AUDIT is not allowed: " in err, err


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("HF_TOKEN", "--allow-env: HF_TOKEN is not refused"),
        ("LD PRELOAD", "--allow-env: 'LD PRELOAD' is not an environment variable name"),
        ("LD_*", "--allow-env: 'LD_*' is not an environment variable name"),
    ],
)
def test_allowed_names_are_checked(tmp_path, capsys, value, complaint):
    with pytest.raises(SystemExit, match=complaint.replace("*", r"\*")):
        render(tmp_path, RESOURCE, "--allow-env", value, capsys=capsys)


@pytest.mark.parametrize("prefix", [None, "", "L", "LD_", "PYTHON", "VLLM_", "P"])
def test_env_from_needs_a_prefix_no_refused_name_starts_with(tmp_path, capsys, prefix):
    source: dict[str, Any] = {"configMapRef": {"name": "tuning"}}
    if prefix is not None:
        source["prefix"] = prefix
    sources = [{"secretRef": {"name": "hf"}, "prefix": "HF_"}, source]
    err = refused(tmp_path, capsys, with_spec(decode={"envFrom": sources}))
    assert "spec.decode.envFrom[1].prefix: " in err, err


def test_env_from_with_a_safe_prefix_passes(tmp_path, capsys):
    sources = [{"secretRef": {"name": "hf"}, "prefix": "HF_"}, {"configMapRef": {"name": "t"}, "prefix": "APP_"}]
    code, _, err = render(tmp_path, with_spec(decode={"envFrom": sources}), capsys=capsys)
    assert code == 0, err


def test_safe_variables_pass(tmp_path, capsys):
    safe = ("HF_TOKEN", "NCCL_DEBUG", "VLLM_LOGGING_LEVEL", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "UCM_DEBUG")
    env = [{"name": name, "value": "1"} for name in safe]
    code, _, err = render(tmp_path, with_spec(decode={"env": env}), capsys=capsys)
    assert code == 0, err


def test_the_operator_reads_engine_arguments_without_vllm():
    # Its image has neither vLLM nor torch (runtime/Dockerfile.operator).
    code = (
        "import sys; sys.modules['vllm'] = sys.modules['torch'] = None\n"
        "from ucm_operator.handlers import plan_of\n"
        "from ucm import engine_args\n"
        "assert engine_args.dests('--trust_remote') == ['trust_remote_code']\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
