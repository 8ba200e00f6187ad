"""LoRA adapters through the PD stack, against a fresh engine: never a wrong answer, and adapters
cost the shared cache nothing (issue 67).

The stack is ``ucm up``'s (``LocalStack``) on the demo model: two prefill engines routed
``kv_aware`` (their KV events and the store's) and one decode engine, on one POSIX store, serving
``--adapters`` LoRA adapters (``spec.lora``, made offline: ``ucm_testing.adapters``) beside the base
model. Each arm — the base model and every adapter — has its own long system prompt and
``--questions`` questions; the requests of all arms are interleaved (a seeded shuffle) and sent by
``--clients`` clients, streamed.

Two runs of the same trace, each under a ``cache_salt`` of its own (cold engines and store):
``adapters`` (each arm's requests name its adapter) and ``base_only`` (every request names the
base model). Reported:

- ``lora_wrong_answers``: answers of the ``adapters`` run that differ from a fresh engine's (no
  store, the same adapters) for the same model and prompt, compared over the greedy steps where
  the fresh engine's top-2 log-probabilities differ by at least ``MARGIN`` (a near-tie may flip with
  the batch's shape; wrong KV changes everything). Must be 0.
- ``lora_hit_tokens_vs_no_adapters``: prompt tokens the prefill pool did not compute (its engines'
  own prefix caches plus the store's loads) in the ``adapters`` run over the ``base_only`` run's.
  Bound: 1.0 (the same prefixes, as many of them). Target ≥ 0.9.
- TTFT p50/p99 per arm, and over each run.

    python benchmarks/lora_serving.py --quick --json OUT.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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
from ucm.deploy.roles import BACKEND_KEY
from ucm.deploy.spec import UCMDeploymentSpec
from ucm_testing.adapters import RANK, ensure_adapter
from ucm_testing.vllm_server import VLLMServer, metric_totals

BASE = "tiny"  # the stack's served name (default_spec)
MARGIN = 0.1  # log-probability gap of the reference's top 2 below which a step is a near-tie
ANSWER_TOKENS = 12
SENTENCES = CORPUS.split("\n")
PREFILL_HITS = ("vllm:prefix_cache_hits_total", "ucm_connector_external_hit_tokens_total")


def system_prompt(arm: int, chars: int) -> str:
    """An arm's own long instructions: the corpus's sentences in an order of its own."""
    rng = random.Random(1000 + arm)
    out = f"Assistant {arm}. Read the notes below, then answer.\n"
    while len(out) < chars:
        out += " ".join(rng.sample(SENTENCES, len(SENTENCES))) + "\n"
    return out[:chars]


def build_trace(arms: list[str], questions: int, chars: int) -> list[tuple[int, str]]:
    """(arm, prompt) for every request, the arms interleaved."""
    rng = random.Random(7)
    trace = []
    for a in range(len(arms)):
        system = system_prompt(a, chars)
        for q in range(questions):
            trace.append((a, f"{system}\nQuestion {q}: {rng.choice(SENTENCES)[:40]}"))
    rng.shuffle(trace)
    return trace


# Tokens as ids ("token_id:N"): the demo model's byte-level pieces are not always whole characters.
AS_IDS = {"logprobs": 1, "return_tokens_as_token_ids": True}


async def stream(http: aiohttp.ClientSession, url: str, model: str, prompt: str, salt: str) -> tuple[float, list[str]]:
    """(TTFT, tokens) of one streamed greedy completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
        "stream": True,
        "cache_salt": salt,
        **AS_IDS,
    }
    started, first, tokens = time.perf_counter(), None, []
    async with http.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            got = (choice.get("logprobs") or {}).get("tokens") or []
            if got and first is None:
                first = time.perf_counter()
            tokens += got
    return (first or time.perf_counter()) - started, tokens


async def run_trace(url: str, trace: list[tuple[int, str]], models: list[str], salt: str, clients: int):
    results: list[tuple[int, float, list[str]] | None] = [None] * len(trace)
    queue = list(range(len(trace)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def client() -> None:
            while queue:
                i = queue.pop(0)
                arm, prompt = trace[i]
                ttft, tokens = await stream(http, url, models[arm], prompt, salt)
                results[i] = (arm, ttft, tokens)

        await asyncio.gather(*(client() for _ in range(clients)))
    return results


def reference(server: VLLMServer, model: str, prompt: str) -> tuple[list[str], list[float]]:
    """The fresh engine's greedy tokens and, per step, its top-2 log-probability gap."""
    body = {"model": model, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0, **AS_IDS, "logprobs": 2}
    r = server.post("/v1/completions", body)["choices"][0]["logprobs"]
    gaps = []
    for top in r["top_logprobs"]:
        values = sorted(top.values(), reverse=True)
        gaps.append(values[0] - values[1] if len(values) > 1 else float("inf"))
    return r["tokens"], gaps


def checked_prefix(tokens: list[str], gaps: list[float]) -> list[str]:
    """The reference's tokens up to its first near-tie: what any engine serving the right KV says."""
    out = []
    for token, gap in zip(tokens, gaps, strict=True):
        if gap < MARGIN:
            break
        out.append(token)
    return out


def warm(urls: list[str], models: list[str], key: str) -> None:
    """Every engine loads every adapter before the runs: a first load takes a second, which would
    reorder the runs' requests (steady state is adapters loaded)."""
    for url in urls:
        for model in models:
            body = json.dumps({"model": model, "prompt": "warm", "max_tokens": 1}).encode()
            request = urllib.request.Request(
                url + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
            )
            with urllib.request.urlopen(request, timeout=120) as r:
                r.read()


def prefill_hits(urls: list[str]) -> float:
    return sum(metric_totals(u).get(name, 0.0) for u in urls for name in PREFILL_HITS)


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"ttft_p50_s": round(statistics.median(ordered), 4), "ttft_p99_s": round(p99, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 questions per arm, shorter system prompts")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--questions", type=int, default=None, help="per arm (default 6; --quick 2)")
    parser.add_argument("--system-chars", type=int, default=None, help="default 2400; --quick 1200")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--run-dir", type=Path, help="keep the stack's files and logs here")
    args = parser.parse_args()
    questions = args.questions or (2 if args.quick else 6)
    chars = args.system_chars or (1200 if args.quick else 2400)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="ucm-lora-"))
    model = ensure_model(TINY)
    adapters = {f"ad{i}": ensure_adapter(TINY, i, run_dir / "adapters") for i in range(1, args.adapters + 1)}
    arms = [BASE, *adapters]

    spec = default_spec(model)
    spec["prefill"] = {"replicas": 2}
    spec["lora"] = {
        "adapters": [{"name": name, "source": {"hostPath": str(path)}} for name, path in adapters.items()],
        "maxAdapters": len(adapters),
        "maxRank": RANK,
    }
    stack = LocalStack(UCMDeploymentSpec.model_validate(spec), run_dir)
    modules = [f"{name}={path}" for name, path in adapters.items()]
    lora_args = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(RANK)]
    fresh = VLLMServer(model, run_dir / "fresh.log", extra_args=[*lora_args, "--lora-modules", *modules])

    def progress(message: str, _waiting: list[Any]) -> None:
        if message:
            print(f"  {message}", file=sys.stderr, flush=True)

    trace = build_trace(arms, questions, chars)
    nonce = f"{time.time_ns()}"
    try:
        fresh.start()
        stack.start(progress)
        fresh.wait_ready()
        roles = stack.state()["roles"]
        prefills = [p["url"] for name, p in roles.items() if name.startswith("prefill")]
        engines = [p["url"] for name, p in roles.items() if name.startswith(("prefill", "decode"))]
        warm(engines, arms, stack.credentials[BACKEND_KEY])  # the engines' own key, not the proxy's
        runs: dict[str, Any] = {}
        for run, models in (("adapters", arms), ("base_only", [BASE] * len(arms))):
            before = prefill_hits(prefills)
            started = time.perf_counter()
            results = asyncio.run(
                run_trace(stack.base_url.removesuffix("/v1"), trace, models, f"{run}-{nonce}", args.clients)
            )
            runs[run] = {
                "seconds": round(time.perf_counter() - started, 2),
                "prefill_hit_tokens": prefill_hits(prefills) - before,
                "results": results,
            }
        wrong, checked, mismatches = 0, 0, []
        for i, ((arm, prompt), (_, _, served)) in enumerate(zip(trace, runs["adapters"]["results"], strict=True)):
            tokens, gaps = reference(fresh, model=str(model) if arm == 0 else arms[arm], prompt=prompt)
            expected = checked_prefix(tokens, gaps)
            checked += len(expected)
            if served[: len(expected)] != expected:
                wrong += 1
                step = next((k for k, (a, b) in enumerate(zip(served, expected, strict=False)) if a != b), len(served))
                mismatches.append(
                    {"request": i, "arm": arms[arm], "step": step, "gap": round(gaps[step], 3), "served": served,
                     "expected": tokens}
                )  # fmt: skip
    finally:
        stack.stop()
        fresh.stop()

    per_arm = {}
    for a, name in enumerate(arms):
        ttfts = [ttft for arm, ttft, _ in runs["adapters"]["results"] if arm == a]
        per_arm[name] = percentiles(ttfts)
    hits = {run: runs[run]["prefill_hit_tokens"] for run in runs}
    summary = {
        "lora_wrong_answers": wrong,
        "lora_tokens_checked": checked,
        "lora_mismatches": mismatches,
        "lora_tokens_served": ANSWER_TOKENS * len(trace),
        "lora_hit_tokens_vs_no_adapters": round(hits["adapters"] / hits["base_only"], 3) if hits["base_only"] else None,
        "lora_hit_tokens_vs_no_adapters_bound": 1.0,
        "prefill_hit_tokens": hits,
        "requests_per_run": len(trace),
        "ttft_by_arm": per_arm,
        "ttft_by_run": {run: percentiles([t for _, t, _ in runs[run]["results"]]) for run in runs},
        "seconds_by_run": {run: runs[run]["seconds"] for run in runs},
        "adapters": len(adapters),
        "questions_per_arm": questions,
        "system_chars": chars,
        "clients": args.clients,
    }
    print(f"{'arm':<10}{'TTFT p50 s':>12}{'TTFT p99 s':>12}")
    for name, figures in per_arm.items():
        print(f"{name:<10}{figures['ttft_p50_s']:>12}{figures['ttft_p99_s']:>12}")
    for run in runs:
        print(f"run {run:<10} prefill hit tokens {hits[run]:>8.0f}   {summary['ttft_by_run'][run]}")
    print(
        f"wrong answers {wrong} of {len(trace)} ({checked} of {ANSWER_TOKENS * len(trace)} tokens checked); "
        "hit tokens vs no adapters "
        f"{summary['lora_hit_tokens_vs_no_adapters']} (bound 1.0)"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
