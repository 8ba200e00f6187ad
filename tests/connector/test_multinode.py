"""A tensor-parallel engine spread over two "nodes": the commands the operator renders for a
LeaderWorkerSet's leader and worker, run for real as two vLLM processes on loopback (vLLM's
``--nnodes 2`` multiprocessing executor, TP=2, one rank per process), with UCMConnector on a shared
store.

Checked: the answers equal a TP=1 engine's; each rank keeps its own shard of every block in the
store; a fresh group loads a prompt whose shards are all there, and stops its hit at a block one
rank's shard is missing from (a partial shard set is never loaded).

TP=1 and TP=2 add up the same products in a different order (the attention and MLP outputs are
all-reduced across ranks), so the greedy tokens are compared up to a flip between two tokens whose
log-probabilities differ by less than ``NEAR_TIE`` (none occurred when written), and the
log-probabilities of the tokens both chose within ``NEAR_TIE``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ucm.deploy.plan import KV_CONFIG_FILE
from ucm.hashing import BlockHasher, HashContext
from ucm.integration.vllm.config import kv_transfer_config
from ucm.integration.vllm.identity import weights_fingerprint
from ucm.integration.vllm.metadata import store_keys
from ucm_testing.engine_group import EngineGroup
from ucm_testing.prompts import PROMPTS
from ucm_testing.vllm_server import VLLMServer, cached_tokens, serving

pytestmark = [pytest.mark.slow, pytest.mark.engines]
BS = 32
NEAR_TIE = 1e-3
# KV computed under one TP and read under another: a TP=2 engine's own answer differed from TP=1's
# by 1.6e-3 in one token's log-probability in one run of twenty-odd; a share landed in the wrong
# heads changes the answer outright.
CROSS_TP = 5e-3


MODEL = {"dtype": "float32", "blockSize": BS, "maxModelLen": 1024}


def group(tiny_model: Path, kv_config: Path, logs: Path, name: str) -> EngineGroup:
    """The TP=2 engine over two processes, one core each."""
    return EngineGroup(tiny_model, kv_config, logs, name, model_spec=MODEL, tensor=2, nodes=2, cores=["0", "1"])


def same_greedy_answer(got: dict, want: dict, tie: float = NEAR_TIE) -> None:
    g, w = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    for i, (token, reference) in enumerate(zip(g["tokens"], w["tokens"], strict=True)):
        top = sorted(w["top_logprobs"][i].values(), reverse=True)
        if token != reference:  # a near tie flipped by the order of the sums; the rest follows it
            assert top[0] - top[1] < tie, f"token {i}: {token!r} vs {reference!r}, reference top-2 {top}"
            return
        assert math.isclose(g["token_logprobs"][i], w["token_logprobs"][i], abs_tol=tie), i


def shard_files(store: Path, tiny_model: Path, prompt_ids: list[int], block: int) -> list[Path]:
    """The store files of each rank's share of the prompt's ``block``, as the connector names them."""
    context = HashContext(
        model=str(tiny_model),
        dtype="float32",
        block_size=BS,
        tp_size=2,
        weights=weights_fingerprint(str(tiny_model)),
    )
    block_id = BlockHasher(context).block_ids(prompt_ids)[block]
    keys = [store_keys([block_id], rank, 2)[0].hex() for rank in (0, 1)]
    return [store / key[:2] / key for key in keys]


@pytest.fixture(scope="module")
def want(plain: VLLMServer) -> list[dict]:
    """A plain TP=1 engine's answers to PROMPTS[:2] (16 tokens, with log-probabilities)."""
    return [plain.complete(p, max_tokens=16, logprobs=2) for p in PROMPTS[:2]]


def test_a_two_node_tensor_parallel_engine_answers_as_one_and_keeps_a_shard_per_rank(tiny_model, tmp_path, want):
    from transformers import AutoTokenizer

    store, logs = tmp_path / "kv", tmp_path / "logs"
    store.mkdir()
    logs.mkdir()
    kv_config = tmp_path / KV_CONFIG_FILE
    kv_config.write_text(json.dumps(kv_transfer_config({"spec": "posix", "posix": {"roots": [str(store)]}})))
    prompts = PROMPTS[:2]
    ids = [AutoTokenizer.from_pretrained(tiny_model)(p)["input_ids"] for p in prompts]
    assert all(len(i) >= 3 * BS for i in ids)

    with group(tiny_model, kv_config, logs, "first") as engine:
        for prompt, w in zip(prompts, want, strict=True):
            same_greedy_answer(engine.complete(prompt, max_tokens=16, logprobs=2), w)
    for prompt_ids in ids:
        for block in range(len(prompt_ids) // BS):
            assert all(f.is_file() for f in shard_files(store, tiny_model, prompt_ids, block)), block

    # One rank's share of the second prompt's block 1 goes missing: that block and the rest of the
    # prompt are recomputed, never loaded from rank 0's share alone.
    shard_files(store, tiny_model, ids[1], 1)[1].unlink()
    with group(tiny_model, kv_config, logs, "second") as engine:  # a fresh prefix cache
        whole, partial = (engine.complete(p, max_tokens=16, logprobs=2) for p in prompts)
        assert cached_tokens(whole) == min(len(ids[0]) // BS * BS, len(ids[0]) - 1)  # one token is computed
        assert cached_tokens(partial) == BS
        same_greedy_answer(whole, want[0])
        same_greedy_answer(partial, want[1])


def test_pools_of_different_tp_share_blocks_when_both_split_them_by_the_larger(tiny_model, tmp_path, want):
    """Prefill TP=2 -> decode TP=1, and TP=1 -> TP=2, through one store: both engines set
    ``store_tp: 2``, so a block is kept as two shares (a KV head each) whoever wrote it; the TP=1
    engine reads and writes both shares of each block, the TP=2 engine's ranks one each. Every
    prompt block after the first engine's run is a hit for the other, and the answers are a plain
    TP=1 engine's."""
    from transformers import AutoTokenizer

    store, logs = tmp_path / "kv", tmp_path / "logs"
    store.mkdir()
    logs.mkdir()
    kv = kv_transfer_config({"spec": "posix", "posix": {"roots": [str(store)]}}, store_tp=2)
    prompts = PROMPTS[:2]
    ids = [AutoTokenizer.from_pretrained(tiny_model)(p)["input_ids"] for p in prompts]
    full = [min(len(i) // BS * BS, len(i) - 1) for i in ids]  # one prompt token is always computed

    def engine(name: str, tp: int) -> VLLMServer:
        extra = ["--tensor-parallel-size", str(tp)]
        cores = "0-1" if tp == 1 else "0|1"
        return VLLMServer(tiny_model, logs / f"{name}.log", kv_transfer_config=kv, extra_args=extra, threads_bind=cores)

    def answers(server: VLLMServer, which: list[int]) -> list[dict]:
        try:
            return [server.complete(prompts[i], max_tokens=16, logprobs=2) for i in which]
        finally:
            server.stop()  # its cores to the next

    # The three start at once; each is asked nothing until the one before it has written, so only
    # the store can serve it.
    prefill, decode_tp1, decode_tp2 = engine("prefill-tp2", 2), engine("decode-tp1", 1), engine("decode-tp2", 2)
    with serving(prefill, decode_tp1, decode_tp2):
        answers(prefill, [0])
        read, written = answers(decode_tp1, [0, 1])  # reads prompt 0's shares, writes prompt 1's
        assert cached_tokens(read) == full[0]
        same_greedy_answer(read, want[0], CROSS_TP)
        same_greedy_answer(written, want[1])  # computed by TP=1 itself
        for block in range(len(ids[1]) // BS):  # the TP=1 engine wrote both shares, as TP=2 ranks would
            assert all(f.is_file() for f in shard_files(store, tiny_model, ids[1], block)), block
        (read,) = answers(decode_tp2, [1])
        assert cached_tokens(read) == full[1]
        same_greedy_answer(read, want[1], CROSS_TP)
