"""`ucm store stats|verify|gc`, run as the installed console script."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ucm.integration.vllm.config import kv_transfer_config
from ucm.store import create_store

UCM = shutil.which("ucm", path=str(Path(sys.executable).parent)) or "ucm"


def ucm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([UCM, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def filled(tmp_path):
    root = tmp_path / "kv"
    root.mkdir()
    config = {"spec": "posix", "posix": {"roots": [str(root)]}}
    store = create_store(config)
    ids = [os.urandom(32) for _ in range(10)]
    store.wait(store.dump(ids, [os.urandom(1000) for _ in ids]))
    store.close()
    path = tmp_path / "store.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, root, ids


def test_stats_counts_blocks_and_bytes(filled):
    path, _, _ = filled
    r = ucm("store", "stats", "--config", str(path), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["blocks"] == 10 and out["bytes"] == 10 * (1000 + 32)
    assert "blocks: 10" in ucm("store", "stats", "-c", str(path)).stdout


def test_verify_reports_and_repairs_corrupt_blocks(filled):
    path, root, ids = filled
    victim = next(p for p in root.rglob(ids[3].hex()))
    data = bytearray(victim.read_bytes())
    data[0] ^= 1
    victim.write_bytes(data)
    r = ucm("store", "verify", "-c", str(path))
    assert r.returncode == 1
    assert "checked 10 blocks: 1 corrupt" in r.stdout and ids[3].hex() in r.stdout
    r = ucm("store", "verify", "-c", str(path), "--repair", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["corrupt"] == [ids[3].hex()]
    assert ucm("store", "verify", "-c", str(path)).returncode == 0


def test_gc_shrinks_to_target(filled):
    path, _, _ = filled
    r = ucm("store", "gc", "-c", str(path), "--target", "5KiB", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["bytes"] <= 5 * 1024 and out["evicted_blocks"] == 10 - out["blocks"]


def test_config_with_a_store_section_is_accepted(filled, tmp_path):
    path, _, _ = filled
    wrapped = tmp_path / "ucm.yaml"
    wrapped.write_text(yaml.safe_dump({"store": yaml.safe_load(path.read_text()), "hash_algorithm": "sha256"}))
    assert json.loads(ucm("store", "stats", "-c", str(wrapped), "--json").stdout)["blocks"] == 10


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("spec: posix\nposix: {roots: [/definitely/missing]}\n", r"store\.posix\.roots\[0\]: .*does not exist"),
        ("spec: tape\n", "unknown store 'tape'"),
        ("[1, 2", "not valid YAML"),
        ("- a\n- b\n", "must hold a mapping"),
    ],
)
def test_bad_config_is_a_one_line_error(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    r = ucm("store", "stats", "-c", str(path))
    assert r.returncode == 2
    assert r.stderr.startswith("ucm: error: ")
    assert __import__("re").search(message, r.stderr), r.stderr
    assert "Traceback" not in r.stderr


def test_stores_that_cannot_list_say_so(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("spec: empty\n")
    r = ucm("store", "stats", "-c", str(path))
    assert r.returncode == 2 and "empty: this store cannot list its blocks" in r.stderr


def test_an_engines_kv_transfer_config_is_accepted(filled, tmp_path):
    """What an admin has at hand on an engine pod: the kv-transfer-config it was started with
    (``${VAR}``s filled in from the environment, as ``ucm serve`` does)."""
    path, root, _ = filled
    store = yaml.safe_load(path.read_text())
    store["posix"]["roots"] = [str(root).replace(str(tmp_path), "${POD_NAMESPACE}")]
    kv = tmp_path / "kv-transfer-config.json"
    kv.write_text(json.dumps(kv_transfer_config(store, "kv_both", hash_algorithm="sha256")))
    r = subprocess.run(
        [UCM, "store", "stats", "-c", str(kv), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "POD_NAMESPACE": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["blocks"] == 10
    r = ucm("store", "stats", "-c", str(kv))  # the variable unset: said, as ucm serve says it
    assert r.returncode == 2 and "${POD_NAMESPACE}, which is not set in the environment" in r.stderr


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`ucm render -f x | head`: the pipe closes before ucm writes; ucm stops quietly, as tools do."""
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "metadata": {"name": "chat"},
                "spec": {"model": {"source": {"hf": "m"}}, "store": {"type": "posix", "pvc": {"claimName": "kv"}}},
            }
        )
    )
    p = subprocess.Popen([UCM, "render", "-f", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # before ucm has imported what it needs, let alone written
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141 and err == ""
