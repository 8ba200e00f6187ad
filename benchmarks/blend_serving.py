"""Blend in a real vLLM server: retrieval-augmented prompts whose passages were cached alone, in
another order each time. Full recompute, prefix caching (UCMConnector) and Blend side by side in
one run, on a real pretrained model (SmolLM2-135M-Instruct) and real text (Paul Graham's essays):
see benchmarks/real_model.py.

The workload: a pool of ``--pool`` passages of 300-600 tokens; each question draws ``--passages``
of them, shuffled, and one of them carries a needle ("The special magic number is N." at a random
depth of that passage; a passage of its own per question). The prompt, as token ids (the pieces
tokenized alone, as a RAG system with a pre-tokenized corpus sends them): the chat template's head
and an instruction (the first chunk), then each passage after the separator, then the separator,
the question, the template's tail and the answer's start. Every chunk is cached alone first (a
corpus ingested into the store), so prefix caching finds the first chunk only.

Arms, each its own engine on one POSIX store (all alive at once, idle ones waiting; each question
runs every arm in turn, seconds apart, the order reversed every question):

  recompute     plain vLLM, no prefix caching: computes every prompt token
  prefix        UCMConnector, no Blend: the first chunk from its cache, the rest computed
  bound         the prefix engine sent the same prompt again: everything but the question is a
                prefix hit — what a Blend costing nothing would reach
  blend         UCMConnector with Blend at --ratio

Per arm: TTFT p50/p99 (first streamed token), answer accuracy (Wilson 95%; and by the needle's
passage), and against recompute: exact McNemar p, the 95% interval of the paired difference,
greedy agreement of the first 32 tokens. A sweep of ``--sweep`` ratios follows (``--sweep-trials``
questions each, an engine per ratio beside recompute), for the quality/speed curve.

JSON summary keys, at the default ratio: ttft_speedup_vs_recompute, ttft_speedup_vs_prefix_cache,
ttft_speedup_bound_vs_recompute, paired_trials, accuracy_diff_lower_95, token_agreement_vs_recompute.

    make bench-deps
    python benchmarks/blend_serving.py --quick --json OUT.json

make test's smoke: ``--tiny-model`` (real_model.py), 2 questions of 2 passages, a sweep of one
ratio: the flow, not the figures.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import aiohttp
from e2e_serving import percentile  # benchmarks/ is on sys.path when run as a script
from real_model import add_tiny_flag, max_positions, model_and_text, model_label, serving_dtype
from sparse_serving import agreement

from ucm.integration.vllm.config import BlendConfig, Selection, blend_overrides, kv_transfer_config
from ucm_testing.stats import paired, wilson
from ucm_testing.vllm_server import VLLMServer, metric_totals

SEPARATOR = BlendConfig().separator
INSTRUCTION = "Read the passages below, then answer the question.\n"
QUESTION = "\n\nWhat is the special magic number mentioned in the passages above?"
ANSWER_START = "The special magic number is"
ANSWER_TOKENS = 32
SETTLE_S = 1.0  # vLLM's idle engines spin on their queues for ~1 s after a request


class Corpus:
    """Token ids of the passages, the needle passages and the prompt's fixed pieces."""

    def __init__(self, tokenizer: Any, text: str, pool: int, seed: int) -> None:
        self.tok = tokenizer
        ids = self.encode(text)
        rng = random.Random(seed)
        self.pool = []
        at = 0
        for _ in range(pool):  # consecutive windows: distinct text
            n = rng.randrange(300, 601)
            self.pool.append(ids[at : at + n])
            at += n
        self.unused = ids[at:]
        marker = "\x00MESSAGE\x00"
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
        )
        before, after = chat.split(marker)
        self.head = self.encode(before + INSTRUCTION)
        self.separator = self.encode(SEPARATOR)
        self.tail = self.encode(QUESTION + after + ANSWER_START)

    def encode(self, s: str) -> list[int]:
        return self.tok(s, add_special_tokens=False)["input_ids"]


@dataclass
class Question:
    passages: list[list[int]]  # in prompt order, the needle's among them
    number: int
    needle_at: int  # which passage holds the needle (0: the first, farthest from the question)

    def prompt(self, corpus: Corpus) -> list[int]:
        out = list(corpus.head)
        for p in self.passages:
            out += corpus.separator + p
        return out + corpus.separator + corpus.tail


def questions(corpus: Corpus, n: int, k: int, seed: int) -> list[Question]:
    rng = random.Random(seed)
    out = []
    for q in range(n):
        number = rng.randrange(10_000, 100_000)
        needle = corpus.encode(f" The special magic number is {number}. ")
        # the needle's passage: fresh text, the needle at a random depth
        n_words = rng.randrange(300, 601) - len(needle)
        start = (q * 7919) % max(1, len(corpus.unused) - n_words)
        words = corpus.unused[start : start + n_words]
        at = rng.randrange(len(words) + 1)
        haystack = words[:at] + needle + words[at:]
        chosen = [*rng.sample(corpus.pool, k - 1), haystack]
        rng.shuffle(chosen)
        out.append(Question(chosen, number, next(i for i, p in enumerate(chosen) if p is haystack)))
    return out


def engine(model: Path, name: str, store: Path, logs: Path, blend: dict[str, Any] | None) -> VLLMServer:
    args = ["--dtype", serving_dtype(), "--max-model-len", str(max_positions(model)), "--max-num-seqs", "4"]
    kv = None
    if name == "recompute":
        args.append("--no-enable-prefix-caching")
    else:
        extra = {} if blend is None else {"blend": blend}
        # The prefix arm only loads: the prompts it computes must not reach the store, where another
        # arm would find them whole as a prefix.
        role = "kv_consumer" if name == "prefix" else "kv_both"
        kv = kv_transfer_config({"spec": "posix", "posix": {"roots": [str(store)]}}, role, **extra)
        if blend is not None:
            args += ["--hf-overrides", json.dumps(blend_overrides())]
    server = VLLMServer(model, logs / f"{name}.log", kv_transfer_config=kv, extra_args=args, kv_cache_gib=2)
    metrics = logs / f"metrics-{name}"  # the workers' ucm_connector_* samples, summed by the API server
    metrics.mkdir()
    server.env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)
    return server


async def ask(server: VLLMServer, prompt: list[int], tokens: int) -> tuple[float, list[str]]:
    """TTFT (s) and the streamed token texts of a greedy completion."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    texts: list[str] = []
    first = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        started = time.perf_counter()
        async with s.post(server.url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    first = first or time.perf_counter() - started
                    texts.append(json.loads(line[6:])["choices"][0]["text"])
    assert first is not None
    return first, texts


def run(server: VLLMServer, prompt: list[int], tokens: int = ANSWER_TOKENS) -> tuple[float, list[str]]:
    time.sleep(SETTLE_S)
    return asyncio.run(ask(server, prompt, tokens))


@dataclass
class Outcome:
    ttft: list[float]
    texts: list[list[str]]
    correct: list[bool]


def new_outcome() -> Outcome:
    return Outcome([], [], [])


def record(out: Outcome, q: Question, result: tuple[float, list[str]]) -> None:
    ttft, texts = result
    out.ttft.append(ttft)
    out.texts.append(texts)
    out.correct.append(str(q.number) in "".join(texts).replace(",", ""))


def warm(server: VLLMServer, chunks: list[list[int]]) -> None:
    """Each chunk prefilled alone: its blocks land in the store under the ids Blend looks up."""
    for c in chunks:
        server.post("/v1/completions", {"model": server.model, "prompt": c, "max_tokens": 1}, timeout=900)


def row(
    name: str, out: Outcome, reference: Outcome | None, recompute_ttft: list[float], needle_at: list[int]
) -> dict[str, Any]:
    lo, hi = wilson(sum(out.correct), len(out.correct))
    by_passage = [[0, 0] for _ in range(max(needle_at) + 1)]  # [correct, trials] per needle passage
    for at, ok in zip(needle_at, out.correct, strict=False):
        by_passage[at][0] += ok
        by_passage[at][1] += 1
    r: dict[str, Any] = {
        "arm": name,
        "trials": len(out.correct),
        "ttft_p50_s": round(statistics.median(out.ttft), 4),
        "ttft_p99_s": round(percentile(out.ttft, 0.99), 4),
        # paired: each question's recompute TTFT over this arm's, then the median
        "ttft_speedup_vs_recompute": round(
            statistics.median(a / b for a, b in zip(recompute_ttft, out.ttft, strict=False)), 3
        ),
        "accuracy": round(sum(out.correct) / len(out.correct), 4),
        "accuracy_95": [round(lo, 4), round(hi, 4)],
        "accuracy_by_needle_passage": by_passage,
        "ttft_s": [round(t, 4) for t in out.ttft],
    }
    if reference is not None:
        n = len(out.correct)
        p = paired(reference.correct[:n], out.correct)
        r |= {
            "lost_vs_recompute": p.only_first,
            "gained_vs_recompute": p.only_second,
            "mcnemar_p": round(p.mcnemar_p, 4),
            "diff_vs_recompute": round(p.difference, 4),
            "diff_95": [round(p.difference_interval[0], 4), round(p.difference_interval[1], 4)],
            "token_agreement_vs_recompute": round(agreement(out.texts, reference.texts[:n]), 4),
        }
    return r


def blend_counters(server: VLLMServer) -> dict[str, float]:
    totals = metric_totals(server.url)
    return {k: v for k, v in totals.items() if k.startswith("ucm_connector_blend_") and k.endswith("_total")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 questions, a sweep of 20 per ratio")
    ap.add_argument("--trials", type=int, default=200, help="Questions in the main comparison")
    ap.add_argument("--passages", type=int, default=6, help="Passages per question")
    ap.add_argument("--pool", type=int, default=24, help="Passages to draw from")
    ap.add_argument("--ratio", type=float, default=BlendConfig().recompute_ratio, help="Blend's recompute_ratio")
    ap.add_argument(
        "--selection",
        choices=get_args(Selection),
        default=BlendConfig().selection,
        help="Which reused tokens Blend recomputes (its 'selection'; every Blend engine of the run)",
    )
    ap.add_argument("--sweep", default="0,0.05,0.3,1.0", help="Other ratios, for the curve ('' for none)")
    ap.add_argument("--sweep-trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    add_tiny_flag(ap)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.trials, args.sweep_trials = 100, 20
    from transformers import AutoTokenizer

    model, text = model_and_text(args.tiny_model)
    corpus = Corpus(AutoTokenizer.from_pretrained(str(model)), text, args.pool, args.seed)
    qs = questions(corpus, args.trials, args.passages, args.seed)
    chunks = [corpus.head, *corpus.pool, *(q.passages[i] for q in qs for i in range(len(q.passages)))]
    chunks = list({tuple(c): c for c in chunks}.values())
    blend = {"recompute_ratio": args.ratio, "selection": args.selection}
    work = Path(tempfile.mkdtemp(prefix="blend-serving-"))
    store, logs = work / "store", work / "logs"
    store.mkdir()
    logs.mkdir()
    print(f"{len(qs)} questions of ~{statistics.mean(len(q.prompt(corpus)) for q in qs):.0f} tokens; logs in {logs}")
    servers = {
        "recompute": engine(model, "recompute", store, logs, None),
        "prefix": engine(model, "prefix", store, logs, None),
        "blend": engine(model, "blend", store, logs, blend),
    }
    report: dict[str, Any] = {
        "model": f"{model_label(args.tiny_model)} ({serving_dtype()})",
        "passages": args.passages,
        "ratio": args.ratio,
        "selection": args.selection,
    }
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready(600)
        started = time.perf_counter()
        warm(servers["blend"], chunks)  # its own prompts are never saved: blended KV is approximate
        report["warm_s"] = round(time.perf_counter() - started, 1)
        out = {name: new_outcome() for name in ("recompute", "prefix", "bound", "blend")}
        before = blend_counters(servers["blend"])
        for i, q in enumerate(qs):
            prompt = q.prompt(corpus)
            order = ["recompute", "prefix", "blend"]
            for name in order if i % 2 == 0 else order[::-1]:
                record(out[name], q, run(servers[name], prompt))
                if name == "prefix":  # the same prompt again: all but the question is cached
                    record(out["bound"], q, run(servers["prefix"], prompt))
            if (i + 1) % 10 == 0:
                print(f"  {i + 1}/{len(qs)}", {k: round(statistics.median(v.ttft), 3) for k, v in out.items()})
        after = blend_counters(servers["blend"])
        report["blend_counters"] = {k: after[k] - before.get(k, 0) for k in after}
        ref = out["recompute"]
        needle_at = [q.needle_at for q in qs]
        report["arms"] = [
            row(name, o, None if name == "recompute" else ref, ref.ttft, needle_at) for name, o in out.items()
        ]
        for s in ("prefix", "blend"):
            servers[s].stop()
        report["sweep"] = []
        for ratio in [float(r) for r in args.sweep.split(",") if r]:
            name = f"blend-{ratio:g}"
            server = engine(model, name, store, logs, {**blend, "recompute_ratio": ratio}).start().wait_ready(600)
            try:
                sweep = new_outcome()
                recompute = []
                for q in qs[: args.sweep_trials]:
                    record(sweep, q, run(server, q.prompt(corpus)))
                    recompute.append(run(servers["recompute"], q.prompt(corpus))[0])
                report["sweep"].append({"ratio": ratio, **row(name, sweep, ref, recompute, needle_at)})
            finally:
                server.stop()
    finally:
        for s in servers.values():
            s.stop()
    by = {r["arm"]: r for r in report["arms"]}
    report["summary"] = {
        "ttft_speedup_vs_recompute": by["blend"]["ttft_speedup_vs_recompute"],
        "ttft_speedup_vs_prefix_cache": round(
            statistics.median(a / b for a, b in zip(out["prefix"].ttft, out["blend"].ttft, strict=True)), 3
        ),
        "ttft_speedup_bound_vs_recompute": by["bound"]["ttft_speedup_vs_recompute"],
        "paired_trials": by["blend"]["trials"],
        "accuracy_diff_lower_95": by["blend"]["diff_95"][0],
        "token_agreement_vs_recompute": by["blend"]["token_agreement_vs_recompute"],
    }
    show(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def show(report: dict[str, Any]) -> None:
    head = f"{'arm':<12} {'TTFT p50':>9} {'p99':>7} {'x recomp':>8} {'accuracy (95%)':>22} {'diff (95%)':>26}"
    print(f"\n{head} {'agree':>6}")
    for r in [*report["arms"], *report.get("sweep", [])]:
        acc = f"{r['accuracy']:.3f} ({r['accuracy_95'][0]:.3f}-{r['accuracy_95'][1]:.3f})"
        diff = agree = ""
        if "diff_95" in r:
            diff = f"{r['diff_vs_recompute']:+.3f} ({r['diff_95'][0]:+.3f} to {r['diff_95'][1]:+.3f})"
            agree = f"{r['token_agreement_vs_recompute']:.3f}"
        print(
            f"{r['arm']:<12} {r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>6.3f}s {r['ttft_speedup_vs_recompute']:>8.2f} "
            f"{acc:>22} {diff:>26} {agree:>6}"
        )
    print("\naccuracy by the needle's passage (0: the first, farthest from the question), correct/trials:")
    for r in report["arms"]:
        print(f"  {r['arm']:<12}", "  ".join(f"{c}/{n}" for c, n in r["accuracy_by_needle_passage"]))
    print("\nblend counters:", report.get("blend_counters"))
    print("summary:", json.dumps(report["summary"]))


if __name__ == "__main__":
    sys.exit(main())
