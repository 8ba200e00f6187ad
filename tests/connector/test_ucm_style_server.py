"""A real vLLM (CPU build) server started the way UCM's documentation starts one: the connector
named ``UCMDirectConnector`` (no module path: the plugin registers UCM's names) and a
``ucm_config.yaml`` named by ``ucm_config_path`` — an NFS-style store on two local directories
with ``storage_policy: tiered`` and ESA sparse attention. Answers match plain vLLM's, go through
ESA, and a second server loads the first one's blocks from the tiered store."""

from __future__ import annotations

import pytest
import yaml

from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer, cached_tokens, serving

pytestmark = [pytest.mark.slow, pytest.mark.engines]
BS = 32


def blocks_under(root) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file() and len(p.name) == 64)


def test_ucm_style_config_file_serves_correct_cached_answers(tiny_model, tmp_path, plain):
    fast, slow = tmp_path / "ssd", tmp_path / "nfs"
    fast.mkdir()
    slow.mkdir()
    ucm_config = tmp_path / "ucm_config.yaml"
    ucm_config.write_text(
        yaml.safe_dump(
            {
                "ucm_connectors": [
                    {
                        "ucm_connector_name": "UcmNfsStore",
                        "ucm_connector_config": {
                            "storage_backends": f"{fast}:{slow}",
                            "storage_policy": "tiered",
                            "io_direct": False,
                        },
                    }
                ],
                # A full budget decodes token-identically to dense attention, so answers can be compared.
                "ucm_sparse_config": {"min_tokens": 64, "ESA": {"init_window_sz": 1, "sparse_ratio": 1.0}},
                "load_only_first_rank": False,
            }
        )
    )
    kv = {
        "kv_connector": "UCMDirectConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"ucm_config_path": str(ucm_config)},
    }

    def ucm_server(name: str, cores: str) -> VLLMServer:
        server = VLLMServer(tiny_model, tmp_path / f"{name}.log", kv_transfer_config=kv, threads_bind=cores)
        metrics = tmp_path / f"metrics-{name}"
        metrics.mkdir()
        server.env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)
        return server

    # Both start at once; the second is asked nothing until the first has written, so its own
    # prefix cache cannot serve it.
    first, second = ucm_server("first", "1"), ucm_server("second", "0-1")
    with serving(first, second):
        want = [plain.complete(p, max_tokens=24)["choices"][0]["text"] for p in PROMPTS[:2]]
        got = [first.complete(p, max_tokens=24)["choices"][0]["text"] for p in PROMPTS[:2]]
        assert got == want
        metrics = first.metrics()
        assert metrics["ucm_sparse_requests_total"] == 2  # both decoded through ESA
        assert "UCM-style config read as ours" in first.log_tail(200_000)
        first.stop()
        # Written through: every block in the shared tier, copies in the fast one.
        assert blocks_under(slow) > 0 and blocks_under(fast) == blocks_under(slow)
        reply = second.complete(PROMPTS[0], max_tokens=24)
        assert reply["choices"][0]["text"] == want[0]
        assert cached_tokens(reply) >= BS  # loaded from the tiered store, not recomputed
        assert second.metrics()["ucm_connector_loaded_blocks_total"] >= 1
