"""Sparse attention in a real vLLM server: decode throughput and needle-in-a-haystack accuracy,
each algorithm against dense, on a real pretrained model (SmolLM2-135M-Instruct) and real text
(Paul Graham's essays) — see benchmarks/real_model.py for where both come from.

Per engine (dense, then one per algorithm, started in turn on the same cores), per context length:

  decode_tokens_per_s   ``--concurrency`` streamed requests of that many prompt tokens (distinct
                        windows of the essays), ``--decode-tokens`` each; tokens produced by all of
                        them between the moment every one has its first token (all prefills done)
                        and the moment the first one ends, per second: steady decode of long
                        requests, where attention (not weights) dominates a step.
  kv_fraction_attended  from the engine's ucm_sparse_* metrics over that decode (1 for dense).
  needle_accuracy       ``--trials`` requests: "The special magic number is N." inserted into the
                        essays at depths spread from ``--min-depth`` to 1, the question at the end
                        and the answer's start given ("The special magic number is"); correct when
                        N comes next. SmolLM2-135M finds a needle at most ~3.5k tokens back: dense,
                        at 7,000 tokens, it scored 0.5 over depths 0..1 with every miss below depth
                        0.5 (it answers " 11."), so the default ``--min-depth`` is 0.5.

JSON: {"results": [{algorithm, context_tokens, concurrency, decode_tokens_per_s,
kv_fraction_attended, needle_accuracy, trials}...], "default": <algorithm>,
"decode_speedup_vs_dense": x, "needle_accuracy_vs_dense": y} — the two summaries for the default
algorithm at the longest context.

    make bench-deps   # the bench extra (gguf, accelerate) for the model conversion
    python benchmarks/sparse_serving.py --quick --json OUT.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from real_model import essays, smollm2  # benchmarks/ is on sys.path when run as a script

from ucm_testing.vllm_server import VLLMServer, metric_totals

DEFAULT = "esa"
SETTINGS: dict[str, dict[str, Any]] = {
    "esa": {"sparse_ratio": 0.3, "retrieval_stride": 4},
    "gsa": {"sparse_ratio": 0.3},
    "kvstar": {"sparse_ratio": 0.3, "retrieval_stride": 4, "blk_repre_dim_prune_ratio": 0.5},
    "gsa_ondevice": {"sparse_ratio": 0.3},
    "psa": {"eps": 0.95},
}
QUESTION = "\n\nWhat is the special magic number mentioned in the text above?"
ANSWER_START = "The special magic number is"


class Prompts:
    def __init__(self, tokenizer: Any, text: str) -> None:
        self.tok = tokenizer
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def window(self, tokens: int, offset: int) -> str:
        start = offset % max(1, len(self.ids) - tokens)
        return self.tok.decode(self.ids[start : start + tokens])

    def chat(self, user: str) -> str:
        messages = [{"role": "user", "content": user}]
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def needle(self, tokens: int, depth: float, number: int) -> str:
        """~``tokens`` in all: essays with the needle at ``depth``, the question, the answer's start."""
        filler = tokens - 60
        position = int(filler * depth)
        words = self.ids[:filler]
        haystack = (
            self.tok.decode(words[:position])
            + f" The special magic number is {number}. "
            + self.tok.decode(words[position:])
        )
        return self.chat(haystack + QUESTION) + ANSWER_START


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[float]:
    """Arrival time of each streamed token."""
    times: list[float] = []
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    return times


async def decode_throughput(server: VLLMServer, prompts: list[str], tokens: int) -> float:
    body = {"model": server.model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        runs = await asyncio.gather(*(stream(s, server.url, {**body, "prompt": p}) for p in prompts))
    start = max(t[0] for t in runs)  # every request is decoding from here
    end = min(t[-1] for t in runs)  # until the first one ends
    produced = sum(sum(1 for x in t if start < x <= end) for t in runs)
    return produced / (end - start) if end > start else float("nan")


async def needle_accuracy(
    server: VLLMServer, prompts: Prompts, tokens: int, trials: int, min_depth: float, seed: int
) -> float:
    rng = random.Random(seed)
    depths = [min_depth + (1 - min_depth) * i / max(1, trials - 1) for i in range(trials)]
    cases = [(d, rng.randrange(10_000, 100_000)) for d in depths]
    body = {"model": server.model, "max_tokens": 8, "temperature": 0}
    timeout = aiohttp.ClientTimeout(total=3600)
    sem = asyncio.Semaphore(4)

    async def one(depth: float, number: int) -> bool:
        async with sem, aiohttp.ClientSession(timeout=timeout) as s:
            prompt = prompts.needle(tokens, depth, number)
            async with s.post(server.url + "/v1/completions", json={**body, "prompt": prompt}) as r:
                text = (await r.json())["choices"][0]["text"]
        return str(number) in text.replace(",", "")

    hits = await asyncio.gather(*(one(d, n) for d, n in cases))
    return sum(hits) / len(hits)


def engine(model: Path, algorithm: str, logs: Path, kv_gib: int, min_tokens: int) -> VLLMServer:
    args = ["--dtype", "bfloat16", "--max-model-len", "8192", "--max-num-seqs", "16"]
    if algorithm != "dense":
        sparse = {"algorithm": algorithm, "min_tokens": min_tokens, algorithm: SETTINGS[algorithm]}
        args += ["--additional-config", json.dumps({"sparse": sparse})]
    server = VLLMServer(model, logs / f"{algorithm}.log", extra_args=args, kv_cache_gib=kv_gib)
    # VLLMServer passes float32 and 4096 first; later flags win.
    server.env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="ucm-metrics-")
    return server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the default algorithm only; two context lengths")
    p.add_argument("--algorithms", help=f"comma-separated, from {', '.join(SETTINGS)} (default: all; quick: {DEFAULT})")
    p.add_argument("--contexts", help="prompt tokens, comma-separated (default 2000,7000)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--min-depth", type=float, default=0.5, help="shallowest needle (0: the start of the text)")
    p.add_argument("--min-tokens", type=int, default=1024, help="sparse decoding from this context length")
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    algorithms = (args.algorithms or (DEFAULT if args.quick else ",".join(SETTINGS))).split(",")
    contexts = [int(c) for c in (args.contexts or "2000,7000").split(",")]
    from transformers import AutoTokenizer

    model = smollm2()
    prompts = Prompts(AutoTokenizer.from_pretrained(model), essays())
    logs = Path(tempfile.mkdtemp(prefix="sparse-serving-"))
    results: list[dict[str, Any]] = []
    for algorithm in ["dense", *algorithms]:
        server = engine(model, algorithm, logs, args.kv_cache_gib, args.min_tokens).start()
        try:
            server.wait_ready(600)
            for tokens in contexts:
                batch = [prompts.window(tokens, 7919 * i) for i in range(args.concurrency)]
                before = metric_totals(server.url)
                speed = asyncio.run(decode_throughput(server, batch, args.decode_tokens))
                after = metric_totals(server.url)
                attended = after.get("ucm_sparse_blocks_attended_total", 0) - before.get(
                    "ucm_sparse_blocks_attended_total", 0
                )
                available = after.get("ucm_sparse_blocks_available_total", 0) - before.get(
                    "ucm_sparse_blocks_available_total", 0
                )
                accuracy = asyncio.run(
                    needle_accuracy(server, prompts, tokens, args.trials, args.min_depth, seed=tokens)
                )
                row = {
                    "algorithm": algorithm,
                    "context_tokens": tokens,
                    "concurrency": args.concurrency,
                    "decode_tokens_per_s": round(speed, 2),
                    "kv_fraction_attended": round(attended / available, 3) if available else 1.0,
                    "needle_accuracy": round(accuracy, 3),
                    "trials": args.trials,
                }
                results.append(row)
                print(
                    f"{algorithm:>12} {tokens:>6} tokens x{args.concurrency}: {row['decode_tokens_per_s']:>8} tok/s "
                    f"decode, KV read {row['kv_fraction_attended']:.2f}, needle {row['needle_accuracy']:.2f}",
                    flush=True,
                )
        finally:
            server.stop()
    longest = max(contexts)
    base = next(r for r in results if r["algorithm"] == "dense" and r["context_tokens"] == longest)
    default = DEFAULT if DEFAULT in algorithms else algorithms[0]
    mine = next(r for r in results if r["algorithm"] == default and r["context_tokens"] == longest)
    report = {
        "results": results,
        "default": default,
        "decode_speedup_vs_dense": round(mine["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2),
        "needle_accuracy_vs_dense": round(mine["needle_accuracy"] / base["needle_accuracy"], 2)
        if base["needle_accuracy"]
        else None,
        "dense_needle_accuracy": base["needle_accuracy"],
        "needle_depths": [args.min_depth, 1.0],
    }
    print(f"\n{'algorithm':>12} {'tokens':>6} {'tok/s':>8} {'KV read':>8} {'needle':>7}")
    for r in results:
        print(
            f"{r['algorithm']:>12} {r['context_tokens']:>6} {r['decode_tokens_per_s']:>8} "
            f"{r['kv_fraction_attended']:>8} {r['needle_accuracy']:>7}"
        )
    print(
        f"\n{default} at {longest} tokens: decode_speedup_vs_dense {report['decode_speedup_vs_dense']}, "
        f"needle_accuracy_vs_dense {report['needle_accuracy_vs_dense']} (dense accuracy {base['needle_accuracy']})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
