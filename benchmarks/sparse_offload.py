"""Sparse off-load: how many long requests does one decode engine hold in the same KV memory?

Three engines with the same paged KV cache (``--num-gpu-blocks-override``, the same blocks), side by
side in one run, on a real model (SmolLM2-135M-Instruct, benchmarks/real_model.py) and real text:

  dense      vLLM's attention over every block
  sparse     ESA at --sparse-ratio, the first --dense-layers layers dense (UCM's default 2)
  offload    the same ESA, decoding requests' middle blocks moved to a host arena
             (sparse.offload_blocks): each keeps its sink and local windows and a few slots

Each engine gets the same burst: ``--requests`` prompts of ``--context`` tokens (distinct essay
windows: nothing shared), all sent at once, each decoding ``--decode-tokens`` greedy tokens.

  held_most           the most requests vLLM ran at once (its num_requests_running gauge, sampled
                      every 20 ms while the burst ran)
  held_bound          the most the cache can hold: dense and sparse, blocks / a prompt's blocks
                      (a request holds its whole prompt); offload, one prompt being prefilled
                      plus requests holding their windows and slots only (a budget of blocks)
  preemptions         vLLM's preemptions during the burst (a request that did not fit, recomputed)
  output_tokens_per_s all the burst's tokens over its wall time (prefills included)
  offloaded_blocks    blocks moved to the arena, and the cache blocks that gave back

Then what off-load costs a step: ``--speed-rows`` new requests decoding together in every engine (a
batch each cache holds), their decode tokens per second in the window where all of them decode
(sparse_serving.py's measurement: the median of ``--repeats`` rounds, arms alternating, ratios paired
round by round). The bound for offload is sparse: the same selection with no copy to the slots.

And off-load's exactness, in the same engines: ``--identity-prompts`` new prompts sent alone to the
sparse and the offload engine; the share of generated tokens that agree (1.0 expected: the same
blocks are attended). Alone, and not the burst's: a batch of other rows changes vLLM's matrix
shapes, hence rounding, and a prompt seen before is loaded from the engine's store (each engine its
own), holding the KV its burst computed.

    make bench-deps
    python benchmarks/sparse_offload.py --json OUT.json   # ~25 min on 2 cores

make test's smoke: ``--tiny-model`` (real_model.py; ``--dense-layers 0``: it has 2 layers), 2
requests of 1,100 tokens, one speed round, one identity prompt: the flow, not the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from real_model import (  # benchmarks/ is on sys.path when run as a script
    add_tiny_flag,
    max_positions,
    model_and_text,
    model_label,
    serving_dtype,
)
from sparse_serving import measure_speed, paired_ratio

from ucm.integration.vllm.config import kv_transfer_config
from ucm_testing.vllm_server import VLLMServer, metric_totals, serving

BLOCK = 32
# vLLM's engine processes poll their queues with sched_yield for 1 s after their last message: the
# engines share two cores, so each burst waits for the others to go quiet.
SETTLE_S = 2.0
ARMS = ("dense", "sparse", "offload")
MIN_TOKENS = 1024  # the sparse arms select from this length


def sparse_config(arm: str, ratio: float, dense_layers: int, offload_blocks: int) -> dict[str, Any] | None:
    if arm == "dense":
        return None
    config = {
        "algorithm": "esa",
        "min_tokens": MIN_TOKENS,
        "dense_layers": dense_layers,
        "esa": {"sparse_ratio": ratio},
    }
    if arm == "offload":
        config["offload_blocks"] = offload_blocks
    return config


def engine(model: Path, arm: str, logs: Path, store: Path, args: argparse.Namespace) -> VLLMServer:
    extra = {}
    sparse = sparse_config(arm, args.sparse_ratio, args.dense_layers, args.requests * math.ceil(args.context / BLOCK))
    if sparse is not None:
        extra["sparse"] = sparse
    kv = kv_transfer_config({"spec": "posix", "posix": {"roots": [str(store)]}}, "kv_both", **extra)
    engine_args = [
        "--dtype",
        serving_dtype(),
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        str(args.context + args.decode_tokens + BLOCK),
        "--max-num-seqs",
        str(args.requests),
        "--num-gpu-blocks-override",
        str(args.blocks),
        "--no-enable-prefix-caching",
    ]
    return VLLMServer(model, logs / f"{arm}.log", kv_transfer_config=kv, extra_args=engine_args)


def complete(server: VLLMServer, prompt: list[int], tokens: int) -> list[int]:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return server.post("/v1/completions", body, timeout=3600)["choices"][0]["token_ids"]


def burst(server: VLLMServer, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Every prompt at once; the most requests running at once, sampled while they run."""
    before = metric_totals(server.url)
    seen, done = [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(metric_totals(server.url).get("vllm:num_requests_running", 0.0))
            time.sleep(0.02)  # a short burst (make test's smoke) runs for a few tenths of a second

    watcher = threading.Thread(target=watch)
    started = time.perf_counter()
    watcher.start()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda p: complete(server, p, tokens), prompts))
    finally:
        done.set()
        watcher.join()
    wall = time.perf_counter() - started
    after = metric_totals(server.url)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    return {
        "held_most": int(max(seen)),
        "preemptions": int(delta("vllm:num_preemptions_total")),
        "output_tokens_per_s": round(sum(len(o) for o in outputs) / wall, 2),
        "wall_s": round(wall, 1),
        "offloaded_blocks": int(delta("ucm_connector_sparse_offloaded_blocks_total")),
        "offload_blocks_saved": int(delta("ucm_connector_sparse_offload_blocks_saved_total")),
    }


def held_bound(arm: str, args: argparse.Namespace) -> int:
    """The most requests the cache can hold at once (see the module's docstring)."""
    prompt_blocks = math.ceil(args.context / BLOCK)
    if arm != "offload":
        return min(args.requests, args.blocks // prompt_blocks)
    longest = math.ceil((args.context + args.decode_tokens) / BLOCK)
    budget = max(4, math.ceil(args.sparse_ratio * longest))  # ESA's min_blocks 4: windows and slots
    return min(args.requests, 1 + (args.blocks - prompt_blocks) // budget)


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4000, help="prompt tokens per request (native: <= 7,900)")
    p.add_argument("--decode-tokens", type=int, default=512)
    p.add_argument("--requests", type=int, default=12, help="requests in the burst")
    p.add_argument("--blocks", type=int, help="KV blocks of every engine (default: four dense requests)")
    p.add_argument("--sparse-ratio", type=float, default=0.3)
    p.add_argument("--dense-layers", type=int, default=2, help="layers that attend every block (UCM's default 2)")
    p.add_argument("--speed-rows", type=int, default=4, help="requests decoding together in the speed runs")
    p.add_argument("--repeats", type=int, default=3, help="speed rounds (the median is reported)")
    p.add_argument("--identity-prompts", type=int, default=3)
    add_tiny_flag(p)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    model, text = model_and_text(args.tiny_model)
    if args.context + args.decode_tokens + BLOCK > max_positions(model):
        raise SystemExit(f"--context + --decode-tokens: at most {max_positions(model) - BLOCK} (the model's positions)")
    if args.context <= MIN_TOKENS:
        raise SystemExit(f"--context: more than {MIN_TOKENS} tokens, where the sparse arms start selecting")
    args.blocks = args.blocks or 4 * math.ceil((args.context + args.decode_tokens) / BLOCK)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False)["input_ids"]
    windows = args.requests + args.speed_rows + args.identity_prompts
    prompts = [ids[i * 7919 % (len(ids) - args.context) :][: args.context] for i in range(1, windows + 1)]
    speed_prompts = prompts[args.requests : args.requests + args.speed_rows]
    alone, prompts = prompts[args.requests + args.speed_rows :], prompts[: args.requests]
    work = Path(tempfile.mkdtemp(prefix="sparse-offload-"))
    print(f"logs under {work}", flush=True)
    servers = {arm: engine(model, arm, work, work / f"store-{arm}", args) for arm in ARMS}
    for arm in ARMS:
        (work / f"store-{arm}").mkdir()
    rows: dict[str, dict[str, Any]] = {}
    with serving(*servers.values()):
        for arm, server in servers.items():
            complete(server, prompts[0][:64], 2)  # warm-up
            time.sleep(SETTLE_S)
            rows[arm] = {"arm": arm, **burst(server, prompts, args.decode_tokens), "held_bound": held_bound(arm, args)}
            print(json.dumps(rows[arm]), flush=True)
        speeds = measure_speed(servers, speed_prompts, 128, args.repeats)
        same = [
            agreement(
                complete(servers["sparse"], prompt, args.decode_tokens),
                complete(servers["offload"], prompt, args.decode_tokens),
            )
            for prompt in alone
        ]
    dense = rows["dense"]["held_most"]
    report = {
        "model": model_label(args.tiny_model),
        "dtype": serving_dtype(),
        "context": args.context,
        "decode_tokens": args.decode_tokens,
        "requests": args.requests,
        "blocks": args.blocks,
        "block_size": BLOCK,
        "sparse_ratio": args.sparse_ratio,
        "dense_layers": args.dense_layers,
        "rows": list(rows.values()),
        "offload_held_vs_dense": round(rows["offload"]["held_most"] / dense, 2) if dense else None,
        "offload_token_agreement_vs_sparse": [round(s, 4) for s in same],
        "speed": {
            "rows": args.speed_rows,
            "decode_tokens_per_s": {arm: round(speeds[arm].tokens_per_s, 2) for arm in ARMS},
            "runs_tokens_per_s": {arm: speeds[arm].runs_tokens_per_s for arm in ARMS},
            "offload_vs_sparse": round(paired_ratio(speeds["offload"], speeds["sparse"]), 3),
            "offload_vs_dense": round(paired_ratio(speeds["offload"], speeds["dense"]), 3),
            "sparse_vs_dense": round(paired_ratio(speeds["sparse"], speeds["dense"]), 3),
        },
    }
    shape = f"{args.requests} requests of {args.context} + {args.decode_tokens} tokens"
    print(f"\n{args.blocks} blocks of {BLOCK} tokens; {shape}")
    print(f"{'arm':<8} {'held':>5} {'bound':>6} {'preempt':>8} {'out tok/s':>10} {'wall s':>7} {'offloaded':>10}")
    for r in rows.values():
        print(
            f"{r['arm']:<8} {r['held_most']:>5} {r['held_bound']:>6} {r['preemptions']:>8} "
            f"{r['output_tokens_per_s']:>10} {r['wall_s']:>7} {r['offloaded_blocks']:>10}"
        )
    print(f"offload holds {report['offload_held_vs_dense']}x dense; token agreement with sparse: {same}")
    speed = report["speed"]
    print(
        f"{args.speed_rows} rows decoding: tok/s {speed['decode_tokens_per_s']}; offload / sparse (its bound) "
        f"{speed['offload_vs_sparse']}, offload / dense {speed['offload_vs_dense']}, "
        f"sparse / dense {speed['sparse_vs_dense']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
