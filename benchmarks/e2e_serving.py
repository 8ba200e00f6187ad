"""Serving a small trace end to end: one plain vLLM vs the local PD stack (``ucm up``'s plan).

The trace: N requests whose ~1,000-token prompts share a long system prefix (~800 tokens) and end
in a unique question, 32 output tokens each, streamed, at a fixed concurrency. The two cases run
one after the other on the same cores (never at once) with the same model and engine flags:

  plain  one vLLM instance (its own prefix cache), no connector
  pd     ucm-proxy -> prefill vLLM -> POSIX store -> decode vLLM (``LocalStack``, default spec)

Per case: TTFT and inter-token latency p50/p99, output tokens/s over the trace's wall time,
``hit_rate`` (prompt tokens decode loaded from the store / prompt tokens; 0 for plain), and the
prompt tokens vLLM reported as cached. On 2 CPU cores PD is not faster (two engines share the
cores and every request is computed, dumped and loaded); this is the baseline to improve on GPUs.

Then multi-turn chats (``multi_turn``): each turn's prompt is the previous prompt, its answer and a
new user message (as token ids, so the blocks line up), sent to a UCMConnector engine without its
own prefix cache — as when the next turn lands on another replica — once with
``decode_save_blocks: 0`` (only prompt blocks saved: the old behaviour) and once with the default
(blocks filled while decoding saved too). ``hit_rate``: prompt tokens of turns 2.. loaded from the
store / their prompt tokens.

    python benchmarks/e2e_serving.py --quick --json OUT.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from ucm.deploy.demo_model import CORPUS, TINY, ensure_model
from ucm.deploy.local import LocalStack, default_spec
from ucm.deploy.spec import UCMDeploymentSpec
from ucm.integration.vllm.config import ConnectorConfig, kv_transfer_config
from ucm_testing.vllm_server import VLLMServer, metric_totals

MODEL = "tiny"


def build_trace(model_path: Path, n: int, prefix_tokens: int, total_tokens: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    sentences = [s for s in CORPUS.split("\n") if s.strip()]

    def grow(text: str, target: int, start: int) -> str:
        i = start
        while len(tok(text)["input_ids"]) < target:
            text += " " + sentences[i % len(sentences)]
            i += 1
        return text

    system = grow("System: answer briefly.", prefix_tokens, 0)
    return [grow(f"{system}\nQuestion {k}:", total_tokens, 7 * k + 3) for k in range(n)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def one(http: aiohttp.ClientSession, url: str, prompt: str, out_tokens: int) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": out_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    async with http.post(url + "/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return {
        "ttft": stamps[0] - t0 if stamps else float("nan"),
        "itl": [b - a for a, b in itertools.pairwise(stamps)],
        "tokens": usage.get("completion_tokens", len(stamps)),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
    }


async def run_trace(url: str, prompts: list[str], out_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict[str, Any]] = []

    async def worker(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            results.append(await one(http, url, queue.get_nowait(), out_tokens))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await one(http, url, "warm up the engine", 4)  # first-request compilation, uncounted
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def summarize(results: list[dict[str, Any]], wall: float, external_tokens: float) -> dict[str, float]:
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    return {
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p99_s": round(percentile(ttft, 0.99), 4),
        "itl_p50_s": round(statistics.median(itl), 4),
        "itl_p99_s": round(percentile(itl, 0.99), 4),
        "tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 2),
        "hit_rate": round(external_tokens / prompt_tokens, 3) if prompt_tokens else 0.0,
        "reported_cached_rate": round(sum(r["cached_tokens"] for r in results) / prompt_tokens, 3),
        "mean_prompt_tokens": round(prompt_tokens / len(results), 1),
        "wall_s": round(wall, 2),
    }


def chat_turns(model_path: Path, conversations: int, turns: int, user_tokens: int) -> list[list[list[int]]]:
    """Per conversation, per turn: the user message's token ids (from the demo corpus)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    ids = tok(CORPUS.replace("\n", " "), add_special_tokens=False)["input_ids"]
    step = user_tokens * turns
    return [
        [ids[(c * step + t * user_tokens) % (len(ids) - user_tokens) :][:user_tokens] for t in range(turns)]
        for c in range(conversations)
    ]


def multi_turn(model: Path, run_dir: Path, decode_save_blocks: int, chats: list[list[list[int]]], answer: int):
    """Hit rate of turns 2.. on one engine without a prefix cache, for one decode_save_blocks."""
    store = {"spec": "posix", "posix": {"roots": [str(run_dir / "kv")]}}
    (run_dir / "kv").mkdir(parents=True)
    server = VLLMServer(
        model,
        run_dir / "vllm.log",
        kv_transfer_config=kv_transfer_config(store, decode_save_blocks=decode_save_blocks),
        extra_args=["--served-model-name", MODEL, "--no-enable-prefix-caching"],
    ).start()
    prompt_tokens = hit_tokens = 0
    try:
        server.wait_ready()
        hits = "ucm_connector_external_hit_tokens_total"
        for chat in chats:
            history: list[int] = []
            for turn, user in enumerate(chat):
                history += user
                before = server.metrics().get(hits, 0.0)
                body = {"model": MODEL, "prompt": history, "max_tokens": answer, "temperature": 0}
                reply = server.post("/v1/completions", {**body, "ignore_eos": True, "return_token_ids": True})
                if turn:
                    prompt_tokens += len(history)
                    hit_tokens += server.metrics().get(hits, 0.0) - before
                history += reply["choices"][0]["token_ids"]
    finally:
        server.stop()
    return {"decode_save_blocks": decode_save_blocks, "hit_rate": round(hit_tokens / prompt_tokens, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="32 requests (the default trace is 64)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    n = 32 if args.quick else args.requests
    model = ensure_model(TINY)
    prompts = build_trace(model, n, prefix_tokens=800, total_tokens=1000)
    results: dict[str, Any] = {"requests": n, "concurrency": args.concurrency, "output_tokens": args.output_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        plain = VLLMServer(model, Path(tmp) / "plain.log", extra_args=["--served-model-name", MODEL]).start()
        try:
            plain.wait_ready()
            rows, wall = asyncio.run(run_trace(plain.url + "/v1", prompts, args.output_tokens, args.concurrency))
            results["plain"] = summarize(rows, wall, 0.0)
        finally:
            plain.stop()

        stack = LocalStack(UCMDeploymentSpec.model_validate(default_spec(model)), Path(tmp) / "pd")
        stack.start(lambda message, waiting: print(f"  {message}", file=sys.stderr) if message else None)
        try:
            decode = next(x for x in stack.processes if x.role.component == "decode")
            decode_url = f"http://127.0.0.1:{decode.port}"
            hits = "ucm_connector_external_hit_tokens_total"
            before = metric_totals(decode_url).get(hits, 0.0)
            rows, wall = asyncio.run(run_trace(stack.base_url, prompts, args.output_tokens, args.concurrency))
            external = metric_totals(decode_url).get(hits, 0.0) - before
            results["pd"] = summarize(rows, wall, external)
        finally:
            stack.stop()

        chats = chat_turns(model, conversations=2 if args.quick else 4, turns=6, user_tokens=96)
        default = ConnectorConfig.model_validate({"store": {"spec": "empty"}}).decode_save_blocks
        results["multi_turn"] = {
            "before": multi_turn(model, Path(tmp) / "mt-before", 0, chats, answer=64),
            "after": multi_turn(model, Path(tmp) / "mt-after", default, chats, answer=64),
        }
    keys = list(results["plain"])
    print(f"{'':24}{'plain':>12}{'pd':>12}{'pd/plain':>10}")
    for k in keys:
        a, b = results["plain"][k], results["pd"][k]
        ratio = f"{b / a:.2f}" if a else "-"
        print(f"{k:24}{a:>12}{b:>12}{ratio:>10}")
    before, after = results["multi_turn"]["before"], results["multi_turn"]["after"]
    print(f"multi-turn hit rate: {before['hit_rate']} prompt blocks only -> {after['hit_rate']} with decode blocks")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
