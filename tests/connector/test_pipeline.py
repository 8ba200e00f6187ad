"""A pipeline-parallel engine (vLLM's CPU build, PP=2, one stage per process and core) with
UCMConnector on a POSIX store: each stage keeps its share of a block (its layers) under its own
key, and a load that fails on the first stage keeps the second from saving KV computed over it.

The engine runs without ``--enforce-eager``: vLLM 0.32's CPU model runner allocates a later
stage's buffer for the hidden states it receives only in the compile warm-up, so an eager PP engine
dies on its first request (``assert self.intermediate_tensors is not None``), with or without a
connector.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ucm.hashing import BlockHasher, HashContext
from ucm.integration.vllm.config import kv_transfer_config
from ucm.integration.vllm.identity import weights_fingerprint
from ucm.integration.vllm.metadata import store_keys
from ucm.store.posix import TRAILER
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer, cached_tokens, serving

pytestmark = [pytest.mark.slow, pytest.mark.engines]
BS = 32
STAGES = 2


def share_file(store: Path, tiny_model: Path, ids: list[int], block: int, stage: int) -> Path:
    """The store file of ``stage``'s share of block ``block`` of the prompt ``ids``."""
    weights = weights_fingerprint(str(tiny_model))
    context = HashContext(model=str(tiny_model), dtype="float32", block_size=BS, pp_size=STAGES, weights=weights)
    key = store_keys([BlockHasher(context).block_ids(ids)[block]], stage, STAGES)[0].hex()
    return store / key[:2] / key


def written(paths: list[Path], timeout: float = 30.0) -> list[Path]:
    """``paths``, once every one is in the store (a step's saves are written in the background)."""
    deadline = time.monotonic() + timeout
    while not all(p.is_file() for p in paths):
        assert time.monotonic() < deadline, [p.name for p in paths if not p.is_file()]
        time.sleep(0.1)
    return paths


def payload(path: Path) -> np.ndarray:
    return np.frombuffer(path.read_bytes()[: -TRAILER.size], dtype=np.float32)


def test_a_load_failing_on_the_first_stage_leaves_no_kv_computed_over_it_in_the_store(tiny_model, tmp_path):
    """P's blocks are stored; stage 0's share of P's block 1 is corrupted; Q = P + more is asked
    with a cold prefix cache. Its lookup finds P's blocks whole, stage 0's read of block 1 fails
    its checksum, and vLLM recomputes from there; but the step that met the failure had already
    computed Q's new blocks over the missing KV, on stage 1 too (from stage 0's hidden states).
    Stage 1's shares of those blocks must equal the ones a clean run computes: a share saved in
    the failed step would never be rewritten (the store keeps the first copy of a block)."""
    from transformers import AutoTokenizer

    store = tmp_path / "kv"
    store.mkdir()
    kv = kv_transfer_config({"spec": "posix", "posix": {"roots": [str(store)]}})
    engine = VLLMServer(
        tiny_model,
        tmp_path / "pp.log",
        kv_transfer_config=kv,
        extra_args=["--pipeline-parallel-size", str(STAGES)],
        threads_bind="0|1",
    )
    engine.args.remove("--enforce-eager")
    engine.env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    p, q = PROMPTS[0], PROMPTS[0] + " " + PROMPTS[1]
    p_ids, q_ids = tokenizer(p)["input_ids"], tokenizer(q)["input_ids"]
    p_blocks, q_blocks = len(p_ids) // BS, len(q_ids) // BS
    assert q_ids[: p_blocks * BS] == p_ids[: p_blocks * BS] and q_blocks >= p_blocks + 2
    new = range(p_blocks, q_blocks)

    def shares(block_range: range, stage: int) -> list[Path]:
        return [share_file(store, tiny_model, q_ids, b, stage) for b in block_range]

    def cold(prompt: str) -> dict:
        urllib.request.urlopen(urllib.request.Request(engine.url + "/reset_prefix_cache", method="POST"), timeout=10)
        return engine.complete(prompt, max_tokens=4)

    with serving(engine):
        engine.complete(p, max_tokens=4)
        written([f for s in range(STAGES) for f in shares(range(p_blocks), s)])
        victim = shares(range(1, 2), 0)[0]
        data = bytearray(victim.read_bytes())
        data[100] ^= 0xFF
        victim.write_bytes(data)

        cold(q)
        failed = engine.metrics()
        assert failed["ucm_connector_load_failed_blocks_total"] >= 1
        # The step that met the failure computed Q's new blocks, and both stages dropped their saves.
        assert failed["ucm_connector_save_failed_blocks_total"] >= STAGES * len(new)
        after_failure = [payload(f) for f in written(shares(new, 1))]
        written(shares(new, 0))

        for f in shares(new, 0) + shares(new, 1):  # Q's new blocks again, computed over loaded KV
            f.unlink()
        clean = cold(q)
        assert cached_tokens(clean) == p_blocks * BS  # all of P: stage 0's block 1 was saved again
        for block, tainted_or_not, path in zip(new, after_failure, written(shares(new, 1)), strict=True):
            np.testing.assert_allclose(tainted_or_not, payload(path), rtol=1e-4, atol=1e-5, err_msg=f"block {block}")
