"""kv_connector_extra_config validation: every error names the field."""

import pytest

from ucm.config import ConfigError
from ucm.integration.vllm.config import check_vllm_version, parse_connector_config

STORE = {"spec": "posix", "posix": {"roots": ["/tmp"]}}


def test_defaults():
    c = parse_connector_config({"store": STORE})
    assert (c.hash_algorithm, c.load_mode, c.save_mode, c.load_failure) == ("sha256", "layer", "layer", "recompute")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, r"kv_connector_extra_config\.store: Field required"),
        (None, r"kv_connector_extra_config\.store: Field required"),
        ({"store": STORE, "stor": 1}, r"kv_connector_extra_config\.stor: unknown field"),
        ({"store": {"spec": "s3"}}, r"kv_connector_extra_config\.store\.spec: unknown store 's3'"),
        ({"store": {"spec": "posix", "posix": {"roots": "/x"}}}, r"kv_connector_extra_config\.store\.posix\.roots"),
        ({"store": STORE, "hash_algorithm": "crc"}, r"kv_connector_extra_config\.hash_algorithm: .*sha256"),
        ({"store": STORE, "pd_wait_timeout_s": "soon"}, r"kv_connector_extra_config\.pd_wait_timeout_s"),
        ({"store": STORE, "load_mode": "async"}, r"kv_connector_extra_config\.load_mode: .*'layer' or 'step'"),
        ({"store": "posix"}, r"kv_connector_extra_config\.store: Input should be a valid dictionary"),
        ({"store": STORE, "blend": {"recompute_ratio": 2}}, r"kv_connector_extra_config\.blend\.recompute_ratio"),
        ({"store": STORE, "blend": {"separator": ""}}, r"kv_connector_extra_config\.blend\.separator"),
        ({"store": STORE, "blend": {"ratio": 0.1}}, r"kv_connector_extra_config\.blend\.ratio: unknown field"),
    ],
)
def test_errors_name_the_field(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_connector_config(extra)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.5+cpu", "0.32.1rc1"])
def test_supported_versions(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0"])
def test_unsupported_versions_are_refused_clearly(version):
    with pytest.raises(ConfigError, match=rf"supports vLLM >= 0\.32, < 0\.33; this is vLLM {version}"):
        check_vllm_version(version)


def test_the_scheduler_joins_mooncake_without_contributing_memory():
    from ucm.integration.vllm.config import scheduler_store_config

    store = {
        "spec": "cache|mooncake",
        "cache": {"capacity": "1GiB"},
        "mooncake": {"master_address": "m:1", "metadata_server": "http://m:2/metadata", "global_segment_size": "8GiB"},
    }
    lookup_only = scheduler_store_config(store)
    assert lookup_only["mooncake"]["global_segment_size"] == 0
    assert lookup_only["mooncake"]["master_address"] == "m:1" and lookup_only["cache"] == store["cache"]
    assert store["mooncake"]["global_segment_size"] == "8GiB"  # the workers' config is untouched
    assert scheduler_store_config(STORE) is STORE


def test_kv_transfer_config_is_validated_and_needs_no_vllm():
    import subprocess
    import sys

    from ucm.integration.vllm.config import kv_transfer_config

    config = kv_transfer_config(STORE, "kv_consumer", salt="t")
    assert config["kv_connector"] == "UCMConnector" and config["kv_role"] == "kv_consumer"
    assert config["kv_connector_module_path"] == "ucm.integration.vllm"
    assert config["kv_connector_extra_config"] == {"store": STORE, "salt": "t"}
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.load_mode"):
        kv_transfer_config(STORE, load_mode="sometimes")
    # deployment tooling builds it without importing vLLM
    code = "import sys, ucm.integration.vllm.config; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ucms_blend_section_becomes_ours():
    ucm = {"Blend": {"compute_meta": {"model.layers.2.self_attn": {"ratio": 0.1}}, "separator": "\n##\n"}}
    c = parse_connector_config({"store": STORE, "ucm_sparse_config": ucm})
    assert c.blend is not None and c.sparse is None
    assert (c.blend.check_layer, c.blend.recompute_ratio, c.blend.separator) == (2, 0.1, "\n##\n")
    c = parse_connector_config({"store": STORE, "ucm_sparse_config": {"sparse_type": "Blend", "Blend": {}}})
    assert c.blend is not None and (c.blend.recompute_ratio, c.blend.selection) == (0.3, "attention")


@pytest.mark.parametrize(
    ("blend", "message"),
    [
        (
            {"compute_meta": {"model.layers.0.self_attn": {"ratio": 0.1}, "model.layers.9.self_attn": {"ratio": 0.05}}},
            r"ucm_sparse_config\.Blend\.compute_meta: give one layer",
        ),
        ({"compute_meta": {"layers.0": {"ratio": 0.1}}}, r"compute_meta\.layers\.0: expected a layer named"),
        ({"compute_meta": {"model.layers.0.self_attn": {"r": 1}}}, r"expected \{ratio: <share recomputed>\}"),
        (
            {"compute_meta": {"model.layers.0.self_attn": {"ratio": 3}}},
            r"kv_connector_extra_config\.blend\.recompute_ratio",
        ),
    ],
)
def test_ucms_blend_errors_name_the_field(blend, message):
    with pytest.raises(ConfigError, match=message):
        parse_connector_config({"store": STORE, "ucm_sparse_config": {"Blend": blend}})


@pytest.mark.parametrize(
    ("pp", "speculative", "v2", "refused"),
    [(2, {}, False, True), (2, None, False, False), (1, {}, False, False), (2, {}, True, False)],
)
def test_speculative_decoding_with_pipeline_stages_on_the_v1_runner_is_refused(pp, speculative, v2, refused):
    """vLLM's V1 runner ends the connector's step on the last stage only when it drafts: the earlier
    stages would never save, and the last would wait for their word on failed loads."""
    from types import SimpleNamespace

    from ucm.integration.vllm.connector import _check_deferred_saves

    parallel = SimpleNamespace(pipeline_parallel_size=pp)
    config = SimpleNamespace(parallel_config=parallel, speculative_config=speculative, use_v2_model_runner=v2)
    if refused:
        with pytest.raises(ConfigError, match="--speculative-config with --pipeline-parallel-size above 1"):
            _check_deferred_saves(config)
    else:
        _check_deferred_saves(config)


@pytest.mark.parametrize(
    ("tp", "pp", "asynchronous", "speculative", "refused"),
    [
        (2, 1, False, None, None),  # each rank moves its own KV heads
        (1, 2, False, None, "needs one pipeline stage"),
        (1, 1, True, None, "needs synchronous scheduling"),
        (1, 1, False, {}, "decodes one token per step"),
    ],
)
def test_offload_is_refused_where_a_step_can_run_ahead_of_its_moves(tp, pp, asynchronous, speculative, refused):
    from types import SimpleNamespace

    from ucm.integration.vllm.connector import _check_offload

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        scheduler_config=SimpleNamespace(async_scheduling=asynchronous),
        speculative_config=speculative,
    )
    if refused:
        with pytest.raises(ConfigError, match=rf"sparse\.offload_blocks: {refused}"):
            _check_offload(config)
    else:
        _check_offload(config)
