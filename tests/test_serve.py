"""``ucm serve``, the engines' entrypoint: checks before vLLM starts, then the vLLM command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ucm.integration.vllm.config import kv_transfer_config

UCM = str(Path(sys.executable).parent / "ucm")


def write_config(tmp_path: Path, store: dict, **extra) -> Path:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(kv_transfer_config(store, **extra)))
    return path


def serve(config: Path, *vllm: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [UCM, "serve", "--kv-config", str(config), "--dry-run", "--", *vllm],
        capture_output=True,
        text=True,
        env=env,
    )


def test_dry_run_prints_the_vllm_command_with_the_config(tmp_path):
    (tmp_path / "kv").mkdir()
    config = write_config(tmp_path, {"spec": "posix", "posix": {"roots": [str(tmp_path / "kv")]}})
    r = serve(config, "--model", "m", "--port", "8001")
    assert r.returncode == 0, r.stderr
    command = json.loads(r.stdout)
    assert command[1:5] == ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "m"]
    passed = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert passed["kv_connector"] == "UCMConnector"
    assert passed["kv_connector_extra_config"]["store"]["posix"]["roots"] == [str(tmp_path / "kv")]
    # /health turns 503 while the store is stuck (ucm.integration.vllm.health)
    assert command[command.index("--middleware") + 1] == "ucm.integration.vllm.health.HealthMiddleware"


def test_a_missing_store_directory_stops_the_start(tmp_path):
    config = write_config(
        tmp_path, {"spec": "cache|posix", "cache": {"capacity": 1 << 20}, "posix": {"roots": ["/nope"]}}
    )
    r = serve(config, "--model", "m")
    assert r.returncode == 2
    assert "store.posix.roots: /nope does not exist (is the store volume mounted?)" in r.stderr


def test_an_unwritable_store_directory_stops_the_start(tmp_path):
    config = write_config(tmp_path, {"spec": "posix", "posix": {"roots": ["/sys/fs"]}})  # EACCES even for root
    r = serve(config, "--model", "m")
    assert r.returncode == 2 and "/sys/fs is not writable" in r.stderr


def test_environment_variables_fill_the_config(tmp_path):
    store = {"spec": "mooncake", "mooncake": {"master_address": "m:1", "metadata_server": "http://m:2/metadata"}}
    config = tmp_path / "kv.json"
    text = json.dumps(kv_transfer_config(store)).replace(
        '"master_address"', '"local_hostname": "${POD_IP}", "master_address"'
    )
    config.write_text(text)
    r = serve(config, "--model", "m", env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    assert "kv_connector_extra_config.store.mooncake.local_hostname uses ${POD_IP}, which is not set" in r.stderr
    r = serve(config, "--model", "m", env={"PATH": "/usr/bin:/bin", "POD_IP": "10.1.2.3"})
    assert r.returncode == 0, r.stderr
    passed = json.loads(json.loads(r.stdout)[-1])
    assert passed["kv_connector_extra_config"]["store"]["mooncake"]["local_hostname"] == "10.1.2.3"


def test_a_bad_config_names_the_field(tmp_path):
    config = tmp_path / "kv.json"
    config.write_text(
        json.dumps({"kv_connector": "UCMConnector", "kv_connector_extra_config": {"store": {"spec": "tape"}}})
    )
    r = serve(config, "--model", "m")
    assert r.returncode == 2 and "store.spec: unknown store 'tape'" in r.stderr


def test_a_bad_sparse_section_stops_the_start_naming_the_field(tmp_path):
    (tmp_path / "kv").mkdir()
    config = write_config(tmp_path, {"spec": "posix", "posix": {"roots": [str(tmp_path / "kv")]}})
    data = json.loads(config.read_text())
    data["kv_connector_extra_config"]["ucm_sparse_config"] = {"ESA": {"sparse_ratio": 3}}
    config.write_text(json.dumps(data))
    r = serve(config, "--model", "m")
    assert r.returncode == 2
    assert (
        "kv_connector_extra_config.ucm_sparse_config.ESA.sparse_ratio: Input should be less than or equal to 1"
        in r.stderr
    )


def test_engine_processes_share_a_fresh_metrics_directory(tmp_path):
    from ucm.serve import metrics_dir

    first, second = metrics_dir({}), metrics_dir({})
    assert first != second and Path(first).is_dir() and not list(Path(first).iterdir())
    assert metrics_dir({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}) == str(tmp_path)


def test_variables_are_expanded_inside_values_only_and_only_the_pods_own(tmp_path):
    store = {"spec": "mooncake", "mooncake": {"master_address": "m:1", "metadata_server": "http://m:2/metadata"}}
    data = kv_transfer_config(store)
    data["kv_connector_extra_config"]["store"]["mooncake"]["local_hostname"] = "${POD_IP}"
    config = tmp_path / "kv.json"
    config.write_text(json.dumps(data))
    # Expanded over the text, this value would have added a key to the config.
    injected = '10.0.0.1", "salt": "chosen-by-whoever-sets-the-env'
    r = serve(config, "--model", "m", env={"PATH": "/usr/bin:/bin", "POD_IP": injected})
    assert r.returncode == 0, r.stderr
    passed = json.loads(json.loads(r.stdout)[-1])["kv_connector_extra_config"]
    assert passed["store"]["mooncake"]["local_hostname"] == injected and "salt" not in passed

    data["kv_connector_extra_config"]["store"]["mooncake"]["local_hostname"] = "${HF_TOKEN}"
    config.write_text(json.dumps(data))
    r = serve(config, "--model", "m", env={"PATH": "/usr/bin:/bin", "HF_TOKEN": "hf_secret"})
    assert r.returncode == 2 and "hf_secret" not in r.stdout + r.stderr
    assert "local_hostname: ${HF_TOKEN} may not be expanded; only NODE_NAME, POD_IP" in r.stderr


def test_an_engine_that_blends_runs_ucms_model_class(tmp_path):
    (tmp_path / "kv").mkdir()
    store = {"spec": "posix", "posix": {"roots": [str(tmp_path / "kv")]}}
    config = write_config(tmp_path, store, blend={"recompute_ratio": 0.2})
    r = serve(config, "--model", "m")
    assert r.returncode == 0, r.stderr
    command = json.loads(r.stdout)
    assert json.loads(command[command.index("--hf-overrides") + 1]) == {"architectures": ["UCMBlendLlamaForCausalLM"]}
    for theirs in (["--hf-overrides", '{"rope_theta": 5}'], ["--hf-overrides.rope_theta=5"]):  # read as vLLM does
        r = serve(config, "--model", "m", *theirs)
        assert r.returncode == 2, theirs
        assert "kv_connector_extra_config.blend: ucm serve sets --hf-overrides" in r.stderr
    r = serve(write_config(tmp_path, store), "--model", "m")
    assert "--hf-overrides" not in json.loads(r.stdout)  # without blend: vLLM's own class
