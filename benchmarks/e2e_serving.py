"""Serving end to end: one plain vLLM vs the local PD stack (``ucm up``'s plan), same cores.

Two workloads, streamed, greedy, each run on every case one after the other (never at once):

  shared_document  N requests whose ~1,000-token prompts share a long document (~800 tokens) and
                   end in a unique question, 32 output tokens each, at a fixed concurrency
  multi_turn       several conversations interleaved; each turn's prompt is the previous prompt,
                   its answer and a new user message (the first turn carries a ~600-token
                   context), 32 output tokens; a conversation's turns one after another
  cold_one_at_a_time  distinct ~600-token prompts, one request at a time, 8 output tokens: the
                   latency of a lone cold prompt, with no queueing

Cases, given the same two cores (plain: both; PD: one per engine):

  plain         one vLLM instance (its own prefix cache), no connector
  pd            ucm-proxy -> prefill vLLM -> POSIX store -> decode vLLM, with the proxy's selective
                disaggregation (the deployment default: prompts with >= 256 tokens not yet stored
                go through prefill, the rest straight to decode)
  pd_always     the same stack with every request through prefill (min_prefill_tokens: 0)
  decode_alone  the same stack with every request straight to decode: one engine on one core, no
                PD hop — what splitting the cores costs before disaggregation wins or loses anything

The PD cases get exactly the prompts plain got (multi-turn prompts are built from plain's own
answers), and their outputs are compared with plain's: ``mismatched_outputs`` counts the requests
whose text differs. Per case: TTFT and inter-token latency p50/p99, output tokens/s over the
workload's wall time, ``hit_rate`` (prompt tokens decode loaded from the store / prompt tokens),
and the requests by path (``pd``, ``direct``). The summary ratios are over ``multi_turn``.

Then ``decode_save_blocks``: multi-turn chats sent as token ids to a UCMConnector engine without
its own prefix cache (as when the next turn lands on another replica), once with
``decode_save_blocks: 0`` (only prompt blocks saved) and once with the default (blocks filled while
decoding saved too); ``hit_rate``: prompt tokens of turns 2.. loaded from the store.

    python benchmarks/e2e_serving.py --quick --json OUT.json
    python benchmarks/e2e_serving.py --smoke --cases pd --json OUT.json   # make test's: the flow only
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
import urllib.request
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
    texts: list[str] = []
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
                texts.append(chunk["choices"][0]["text"])
    return {
        "prompt": prompt,
        "text": "".join(texts),
        "ttft": stamps[0] - t0 if stamps else float("nan"),
        "itl": [b - a for a, b in itertools.pairwise(stamps)],
        "tokens": usage.get("completion_tokens", len(stamps)),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
    }


async def run_trace(url: str, prompts: list[str], out_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    """The prompts at a fixed concurrency; results in the prompts' order."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[dict[str, Any]] = [{} for _ in prompts]

    async def worker(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            results[i] = await one(http, url, prompts[i], out_tokens)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await one(http, url, "warm up the engine", 4)  # first-request compilation, uncounted
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


async def run_conversations(
    url: str, chats: list[list[str]], out_tokens: int, replay: list[list[str]] | None
) -> tuple[list[dict], float]:
    """Every conversation at once, each one's turns in order. A turn's prompt is the previous
    prompt, its answer and the next user message; ``replay``: another case's prompts instead (so
    both cases see the same inputs). Results conversation by conversation, turn by turn."""

    async def conversation(http: aiohttp.ClientSession, c: int) -> list[dict[str, Any]]:
        history, out = "", []
        for t, user in enumerate(chats[c]):
            prompt = replay[c][t] if replay else f"{history}\nUser: {user}\nAssistant:"
            result = await one(http, url, prompt, out_tokens)
            history = prompt + result["text"]
            out.append(result)
        return out

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await one(http, url, "warm up the engine", 4)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(conversation(http, c) for c in range(len(chats))))
        wall = time.perf_counter() - t0
    return [r for turns in done for r in turns], wall


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
        "requests": len(results),
        "wall_s": round(wall, 2),
    }


def chat_texts(model_path: Path, conversations: int, turns: int, context: int, user: int) -> list[list[str]]:
    """Per conversation, per turn: the user's message (the first turn's with a long context)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    ids = tok(CORPUS.replace("\n", " "), add_special_tokens=False)["input_ids"]

    def text(start: int, n: int) -> str:
        start %= len(ids) - n
        return tok.decode(ids[start : start + n])

    return [
        [
            f"Read this: {text(c * 977, context)}\nWhat is it about?" if t == 0 else text(c * 977 + t * 131, user)
            for t in range(turns)
        ]
        for c in range(conversations)
    ]


def proxy_paths(base_url: str) -> dict[str, float]:
    """The proxy's client requests so far, by path (pd, direct, fallback)."""
    root = base_url.removesuffix("/v1")
    with urllib.request.urlopen(root + "/metrics", timeout=10) as r:
        text = r.read().decode()
    paths: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ucm_proxy_requests_total{"):
            path = line.split('path="', 1)[1].split('"', 1)[0]
            paths[path] = paths.get(path, 0.0) + float(line.rsplit(" ", 1)[1])
    return paths


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


HITS = "ucm_connector_external_hit_tokens_total"
# The proxy's min_prefill_tokens: its default, every request through prefill, or none.
CASES = {"pd": None, "pd_always": 0, "decode_alone": 10**9}


def run_case(url: str, decode_url: str | None, workloads: dict[str, Any], plain: dict[str, list[dict]] | None):
    """Both workloads on one server or stack: summaries, and the results (prompts and outputs)."""
    summaries, rows = {}, {}
    for name, (kind, data, out_tokens, concurrency) in workloads.items():
        before = metric_totals(decode_url).get(HITS, 0.0) if decode_url else 0.0
        paths = proxy_paths(url) if decode_url else {}
        if kind == "trace":
            results, wall = asyncio.run(run_trace(url, data, out_tokens, concurrency))
        else:
            replay = None
            if plain is not None:
                turns = len(data[0])
                replay = [[r["prompt"] for r in plain[name][c * turns : (c + 1) * turns]] for c in range(len(data))]
            results, wall = asyncio.run(run_conversations(url, data, out_tokens, replay))
        external = metric_totals(decode_url).get(HITS, 0.0) - before if decode_url else 0.0
        summary = summarize(results, wall, external)
        if decode_url:
            after = proxy_paths(url)
            summary["paths"] = {p: round(after[p] - paths.get(p, 0.0)) for p in sorted(after)}
        if plain is not None:
            summary["mismatched_outputs"] = sum(
                r["text"] != p["text"] for r, p in zip(results, plain[name], strict=True)
            )
        summaries[name], rows[name] = summary, results
    return summaries, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="32 documents, 4 conversations x 4 turns")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"the stack's cases beside plain, of {', '.join(CASES)} (each starts a stack of its own)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the flow at its smallest (make test): 4 documents, 2 conversations x 2 turns, 2 cold prompts, "
        "8 output tokens, one decode_save_blocks chat; the figures mean nothing",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    cases_run = [c for c in args.cases.split(",") if c]
    if unknown := set(cases_run) - set(CASES):
        p.error(f"--cases: {', '.join(sorted(unknown))} unknown; choose from {', '.join(CASES)}")
    if "pd" not in cases_run:
        p.error("--cases: pd is the summary's case; it must be among them")
    n = 4 if args.smoke else 32 if args.quick else args.requests
    if args.smoke:
        args.output_tokens, args.concurrency = 8, 2
    model = ensure_model(TINY)
    conversations, turns = (2, 2) if args.smoke else (4, 4) if args.quick else (8, 6)
    workloads = {
        "shared_document": (
            "trace",
            build_trace(model, n, prefix_tokens=800, total_tokens=1000),
            args.output_tokens,
            args.concurrency,
        ),
        "multi_turn": (
            "chat",
            chat_texts(model, conversations, turns, context=600, user=48),
            args.output_tokens,
            conversations,
        ),
        "cold_one_at_a_time": (
            "trace",
            # A leading tag no other workload's prompt has: no cache holds any of its blocks.
            [
                f"Note {k}. {chat[0]}"
                for k, chat in enumerate(chat_texts(model, 2 if args.smoke else 12, 1, context=600, user=48))
            ],
            8,
            1,
        ),
    }
    cases: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        plain = VLLMServer(model, Path(tmp) / "plain.log", extra_args=["--served-model-name", MODEL]).start()
        try:
            plain.wait_ready()
            cases["plain"], plain_rows = run_case(plain.url + "/v1", None, workloads, None)
        finally:
            plain.stop()

        for case in cases_run:
            min_tokens = CASES[case]
            spec = default_spec(model)
            split = {} if min_tokens is None else {"min_prefill_tokens": min_tokens}
            spec["proxy"]["config"]["disaggregation"] = split
            stack = LocalStack(UCMDeploymentSpec.model_validate(spec), Path(tmp) / case)
            stack.start(lambda message, waiting: print(f"  {message}", file=sys.stderr) if message else None)
            try:
                decode = next(x for x in stack.processes if x.role.component == "decode")
                cases[case], _ = run_case(stack.base_url, f"http://127.0.0.1:{decode.port}", workloads, plain_rows)
            finally:
                stack.stop()

        chats = chat_turns(model, conversations=1 if args.smoke else 2 if args.quick else 4, turns=6, user_tokens=96)
        default = ConnectorConfig.model_validate({"store": {"spec": "empty"}}).decode_save_blocks
        saved = {
            "before": multi_turn(model, Path(tmp) / "mt-before", 0, chats, answer=64),
            "after": multi_turn(model, Path(tmp) / "mt-after", default, chats, answer=64),
        }
    results: dict[str, Any] = {
        "output_tokens": args.output_tokens,
        "workloads": [{"name": name, **{case: cases[case][name] for case in cases}} for name in workloads],
    }
    turn = {case: cases[case]["multi_turn"] for case in cases}
    results["pd_vs_plain_ttft_p50"] = round(turn["pd"]["ttft_p50_s"] / turn["plain"]["ttft_p50_s"], 3)
    results["pd_vs_plain_ttft_p99"] = round(turn["pd"]["ttft_p99_s"] / turn["plain"]["ttft_p99_s"], 3)
    results["pd_vs_plain_tokens_per_s"] = round(turn["pd"]["tokens_per_s"] / turn["plain"]["tokens_per_s"], 3)
    results["decode_save_blocks"] = saved
    for w in results["workloads"]:
        print(f"\n{w['name']}")
        print(f"{'':22}{'plain':>10}" + "".join(f"{c:>14}" for c in cases_run) * 2)
        print(f"{'':22}{'':>10}{'':>{14 * len(cases_run)}}" + "".join(f"{'/ plain':>14}" for _ in cases_run))
        for k, base in w["plain"].items():
            if not isinstance(base, (int, float)):
                continue
            values = [w[c][k] for c in cases_run]
            ratios = [f"{x / base:.2f}" if base else "-" for x in values]
            print(f"{k:22}{base:>10}" + "".join(f"{x:>14}" for x in values) + "".join(f"{r:>14}" for r in ratios))
        for case in cases_run:
            print(f"{case}: paths {w[case]['paths']}, mismatched outputs {w[case]['mismatched_outputs']}")
    print(
        f"\nmulti_turn pd/plain: TTFT p50 {results['pd_vs_plain_ttft_p50']}, p99 {results['pd_vs_plain_ttft_p99']}, "
        f"tokens/s {results['pd_vs_plain_tokens_per_s']}"
    )
    before, after = saved["before"], saved["after"]
    print(f"decode_save_blocks hit rate: {before['hit_rate']} prompt blocks only -> {after['hit_rate']} with decode's")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
