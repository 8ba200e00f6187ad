"""UCM's own configuration: the book's examples converted (or refused naming the key), the
translation of store names and options, UCM's connector names, and the UCM_* variables."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import yaml

from ucm.cli import main
from ucm.config import ConfigError
from ucm.deploy.spec import UCMDeploymentSpec, deprecated_fields
from ucm.environment import apply_environment
from ucm.integration.vllm.config import native_config, parse_connector_config
from ucm.serve import load_kv_config

BOOK = Path(__file__).parent / "data" / "ucm_book"
# Each example of the book: None when it converts into a config `ucm serve` accepts, else the key
# its refusal names.
EXAMPLES = {
    "ch03_ucm_config.yaml": "metrics_config_path: not supported",
    "ch05_nfs_multipath.yaml": None,
    "ch05_posix_store.yaml": r"ucm_connector_config\.block_size: not supported: tokens per block are vLLM's",
    "ch05_pc_store.yaml": r"ucm_connector_config\.buffer_number: not supported",
    "ch05_cache_store.yaml": None,
    "ch05_ds3fs_store.yaml": r"ucm_connector_config\.ior_entries: not supported",
    "ch05_mooncake_store.yaml": r"ucm_connector_config\.master_server_address: required",
    "ch05_pipeline.yaml": None,
    "ch14_config_yaml.yaml": r"kv_connector_extra_config\.storage: unknown field",
    "ch14_nvidia_kv_config.json": None,
    "ch14_distributed_kv_config.json": "enable_distributed: not supported",
    "ch14_storage_tuning.yaml": r"kv_connector_extra_config\.io_direct: unknown field",
    "ch14_sparse_low_latency.yaml": "ucm_connectors: required",
    "ch14_sparse_high_throughput.yaml": r"ucm_sparse_config\.GSA\.prefetch_enabled: unknown field",
    "ch14_sparse_long_sequence.yaml": "ucm_connectors: required",
}


def test_every_example_of_the_book_is_listed():
    assert sorted(p.name for p in BOOK.iterdir() if p.suffix in (".yaml", ".json")) == sorted(EXAMPLES)


def localized(name: str, tmp_path: Path) -> Path:
    """The example with its absolute paths moved under tmp_path (so ucm serve can check them)."""
    text = (BOOK / name).read_text()
    for top in ("/mnt/", "/data/", "/nvme/"):
        text = text.replace(top, f"{tmp_path}{top}")
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_books_examples_convert_to_what_ucm_serve_accepts_or_are_refused_naming_the_key(name, tmp_path, capsys):
    source = localized(name, tmp_path)
    refusal = EXAMPLES[name]
    code = main(["config", "convert", str(source)])
    out, err = capsys.readouterr()
    if refusal is not None:
        assert code == 2
        assert re.search(refusal, err), err
        return
    assert code == 0, err
    converted = json.loads(out)
    for options in converted["kv_connector_extra_config"]["store"].values():
        for root in options.get("roots", []) if isinstance(options, dict) else []:
            Path(root).mkdir(parents=True, exist_ok=True)
    kv = tmp_path / "kv.json"
    kv.write_text(out)
    assert main(["serve", "--kv-config", str(kv), "--dry-run", "--", "--model", "m"]) == 0
    command = json.loads(capsys.readouterr().out)
    assert json.loads(command[-1])["kv_connector"] == "UCMConnector"


def test_an_nfs_store_with_three_paths_tiered():
    native = native_config(
        {
            "ucm_connectors": [
                {
                    "ucm_connector_name": "UcmNfsStore",
                    "ucm_connector_config": {
                        "storage_backends": "/a:/b:/c",
                        "storage_policy": "tiered",
                        "io_direct": False,
                        "stream_number": 16,
                    },
                }
            ],
            "ucm_sparse_config": {"ESA": {"init_window_sz": 1, "sparse_ratio": 0.3, "retrieval_stride": 16}},
            "load_only_first_rank": False,
        }
    )
    assert native["store"] == {
        "spec": "nfs",
        "nfs": {"roots": ["/a", "/b", "/c"], "placement": "tiered", "direct_io": False, "io_threads": 16},
    }
    config = parse_connector_config(native)
    assert config.sparse.algorithm == "esa" and config.sparse.options.sparse_ratio == 0.3


@pytest.mark.parametrize(
    ("name", "spec"),
    [("UcmNfsStore", "nfs"), ("Nfs", "nfs"), ("UcmPosixStore", "posix"), ("pc", "posix"), ("UcmDs3fsStore", "ds3fs")],
)
def test_ucms_store_names(name, spec):
    native = native_config(
        {"ucm_connectors": [{"ucm_connector_name": name, "ucm_connector_config": {"storage_backends": "/x"}}]}
    )
    assert native["store"] == {"spec": spec, spec: {"roots": ["/x"]}}


def test_ucms_pipeline_cache_posix_nfs_keeps_our_capacity_key_for_the_middle_tier():
    entry = {
        "ucm_connector_name": "UcmPipelineStore",
        "ucm_connector_config": {
            "pipeline": "Cache|Posix|Nfs",
            "cache": {"cache_size": "1GiB"},
            "posix": {"storage_backends": "/local", "capacity": "100GiB"},
            "nfs": {"storage_backends": ["/shared"]},
        },
    }
    native = native_config({"ucm_connectors": [entry]})
    assert native["store"] == {
        "spec": "cache|posix|nfs",
        "cache": {"capacity": "1GiB"},
        "posix": {"roots": ["/local"], "capacity": "100GiB"},
        "nfs": {"roots": ["/shared"]},
    }
    del entry["ucm_connector_config"]["posix"]["capacity"]
    with pytest.raises(ConfigError, match=r"store\.posix\.capacity: required when posix is in front"):
        parse_connector_config(native_config({"ucm_connectors": [entry]}))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"ucm_connectors": []}, "ucm_connectors: expected a list with one store"),
        (
            {"ucm_connectors": [{"ucm_connector_name": "Nfs"}, {"ucm_connector_name": "Posix"}]},
            "ucm_connectors: give one store: UCM used the first whose path was available",
        ),
        (
            {"ucm_connectors": [{"ucm_connector_name": "UcmRedisStore"}]},
            r"ucm_connector_name: unknown store 'UcmRedisStore'",
        ),
        (
            {
                "ucm_connectors": [
                    {"ucm_connector_name": "Nfs", "ucm_connector_config": {"storage_backends": "/x", "speed": 3}}
                ]
            },
            r"ucm_connector_config\.speed: unknown option for nfs; accepted: .*io_direct.*storage_backends",
        ),
        (
            {"ucm_connectors": [{"ucm_connector_name": "Nfs", "ucm_connector_config": {"storage_policy": "striped"}}]},
            r"storage_policy: 'striped' is not one of tiered, round_robin, random",
        ),
        ({"storage_backend": "posix"}, "storage_path: required"),
        (  # under the name UCM's own documentation uses, not ours (master_address)
            {
                "ucm_connectors": [
                    {"ucm_connector_name": "UcmMooncakeStore", "ucm_connector_config": {"protocol": "tcp"}}
                ]
            },
            r"ucm_connector_config\.master_server_address: required",
        ),
        ({"load_only_first_rank": True}, "load_only_first_rank: not supported: each tensor-parallel worker"),
        ({"enable_prefix_cache": False}, "enable_prefix_cache: false is not supported"),
        (
            {"storage_path": "/x", "store": {"spec": "posix", "posix": {"roots": ["/y"]}}},
            "give store or UCM's ucm_connectors/storage_backend, not both",
        ),
        ({"ucm_config_path": "/nonexistent/ucm.yaml"}, r"ucm_config_path: cannot read /nonexistent/ucm\.yaml"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_connector_config(extra)


def test_ucm_config_path_is_read_and_may_not_repeat_an_inline_key(tmp_path, caplog):
    path = tmp_path / "ucm_config.yaml"
    path.write_text(
        yaml.safe_dump(
            {"ucm_connectors": [{"ucm_connector_name": "Posix", "ucm_connector_config": {"storage_backends": "/x"}}]}
        )
    )
    with caplog.at_level(logging.WARNING, logger="ucm"):
        native = native_config({"ucm_config_path": str(path), "salt": "s"})
    assert native == {"store": {"spec": "posix", "posix": {"roots": ["/x"]}}, "salt": "s"}
    notices = [r.getMessage() for r in caplog.records if "UCM-style config read as ours" in r.getMessage()]
    assert len(notices) == 1 and "store 'posix'" in notices[0]
    with pytest.raises(ConfigError, match="ucm_connectors is given both in the file and inline"):
        native_config({"ucm_config_path": str(path), "ucm_connectors": []})


def test_ucm_serve_takes_ucms_connector_name_and_refuses_another(tmp_path):
    (tmp_path / "kv").mkdir()
    kv = tmp_path / "kv.json"
    extra = {"storage_backend": "nfs", "storage_path": str(tmp_path / "kv")}
    kv.write_text(json.dumps({"kv_connector": "UCMDirectConnector", "kv_connector_extra_config": extra}))
    config = load_kv_config(kv)
    assert config["kv_connector"] == "UCMConnector" and config["kv_connector_module_path"] == "ucm.integration.vllm"
    assert config["kv_connector_extra_config"] == {"store": {"spec": "nfs", "nfs": {"roots": [str(tmp_path / "kv")]}}}
    kv.write_text(json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": extra}))
    with pytest.raises(ConfigError, match="kv_connector 'LMCacheConnectorV1' is not UCM's"):
        load_kv_config(kv)


def test_vllm_finds_the_connector_by_ucms_names():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from ucm.integration.vllm.connector import UCMConnector
    from ucm.integration.vllm.plugin import register

    register()
    register()  # vLLM may run plugins more than once in a process
    for name in ("UCMDirectConnector", "UnifiedCacheConnectorV1", "UCMConnector"):
        assert KVConnectorFactory.get_connector_class_by_name(name) is UCMConnector


@pytest.fixture
def ucm_logger():
    logger = logging.getLogger("ucm")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    yield logger
    for h in logger.handlers:
        if h not in saved[1]:
            h.close()
    logger.level, logger.handlers, logger.propagate = saved[0], saved[1], saved[2]


def test_ucm_log_variables_do_what_the_book_says(tmp_path, ucm_logger):
    log = tmp_path / "ucm.log"
    apply_environment(
        {"UCM_LOG_LEVEL": "debug", "UCM_LOG_FILE": str(log), "UCM_LOG_FORMAT": "%(levelname)s|%(message)s"}
    )
    logging.getLogger("ucm.store.posix").debug("a debug line")
    assert log.read_text() == "DEBUG|a debug line\n"
    apply_environment({"UCM_DEBUG": "true", "UCM_METRICS_ENABLE": "true"})  # replaces the handler, not adds
    assert ucm_logger.level == logging.DEBUG and len([h for h in ucm_logger.handlers if h.get_name()]) == 1
    apply_environment({})  # nothing asked: logging is left as it is
    assert ucm_logger.level == logging.DEBUG


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"UCM_STORAGE_PATH": "/mnt/kv"}, "UCM_STORAGE_PATH: not supported: store directories are store.<kind>.roots"),
        ({"UCM_STORAGE_BACKEND": "posix"}, "UCM_STORAGE_BACKEND: not supported"),
        ({"UCM_BLOCK_SIZE": "16"}, "UCM_BLOCK_SIZE: not supported: tokens per block are vLLM's --block-size"),
        ({"UCM_IO_DIRECT": "true"}, "UCM_IO_DIRECT: not supported"),
        ({"UCM_SPARSE_TYPE": "GSAOnDevice"}, "UCM_SPARSE_TYPE: not supported"),
        ({"UCM_METRICS_PORT": "9090"}, "UCM_METRICS_PORT: not supported: metrics are served on the vLLM server's"),
        ({"UCM_PROFILE": "true"}, "UCM_PROFILE: not supported"),
        ({"UCM_ENABLE_METRICS": "false"}, "UCM_ENABLE_METRICS=false: not supported"),
        ({"UCM_LOG_LEVEL": "LOUD"}, "UCM_LOG_LEVEL: 'LOUD' is not one of DEBUG, INFO"),
        ({"UCM_DEBUG": "maybe"}, "UCM_DEBUG: 'maybe' is not true or false"),
        ({"UCM_DEBUG": "1", "UCM_LOG_LEVEL": "ERROR"}, "UCM_DEBUG=true and UCM_LOG_LEVEL=ERROR disagree"),
        ({"UCM_LOG_FILE": "/nonexistent/dir/ucm.log"}, "UCM_LOG_FILE: cannot open"),
    ],
)
def test_ucm_variables_that_cannot_be_honoured_stop_the_start(environ, message, ucm_logger):
    with pytest.raises(ConfigError, match=message):
        apply_environment(environ)


def test_ucm_serve_refuses_a_refused_variable_before_starting(tmp_path, monkeypatch, capsys):
    (tmp_path / "kv").mkdir()
    kv = tmp_path / "kv.json"
    kv.write_text(json.dumps({"kv_connector_extra_config": {"storage_path": str(tmp_path / "kv")}}))
    monkeypatch.setenv("UCM_BLOCK_SIZE", "32")
    assert main(["serve", "--kv-config", str(kv), "--dry-run", "--", "--model", "m"]) == 2
    assert "UCM_BLOCK_SIZE: not supported" in capsys.readouterr().err


def test_convert_to_a_resource_fragment(tmp_path, capsys):
    assert main(["config", "convert", str(BOOK / "ch05_cache_store.yaml"), "--to", "resource"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out) == {"spec": {"store": {"type": "nfs", "cacheSize": 1073741824}}}
    assert "# store.nfs: the volume every engine mounts" in out and "/mnt/nfs/kv_cache" in out
    assert main(["config", "convert", str(BOOK / "ch14_sparse_low_latency.yaml"), "--to", "resource"]) == 0
    sparse = yaml.safe_load(capsys.readouterr().out)["spec"]["sparse"]
    assert sparse == {
        "algorithm": "gsa_ondevice",
        "gsaOndevice": {"hashTopkTokens": 2048, "sinkToken": 32, "recentToken": 256},  # the resource's spelling
    }
    # UCM's Blend (a ucm_sparse_config that chooses it) becomes spec.blend, the resource accepting it.
    blend = tmp_path / "blend.yaml"
    blend.write_text(yaml.safe_dump({"ucm_sparse_config": {"Blend": {"separator": "\n##\n"}}}))
    assert main(["config", "convert", str(blend), "--to", "resource"]) == 0
    spec = yaml.safe_load(capsys.readouterr().out)["spec"]
    assert spec["blend"]["separator"] == "\n##\n" and "sparse" not in spec
    full = {**spec, "model": {"source": {"hf": "x"}}, "store": {"type": "posix", "pvc": {"claimName": "kv"}}}
    UCMDeploymentSpec.model_validate(full)
    assert deprecated_fields(full) == []
