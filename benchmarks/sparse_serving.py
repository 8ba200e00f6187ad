"""Sparse attention in a real vLLM server: does it pay, and what does it cost? Dense, each algorithm
and a zero-cost static selection, side by side in one run, on a real pretrained model
(SmolLM2-135M-Instruct) and real text (Paul Graham's essays): see benchmarks/real_model.py.

Every arm's engine of one model configuration runs at once (idle ones wait without spinning), each
with UCMConnector on one POSIX store: dense computes every prompt first and writes its KV to the
store, the other arms load it instead of recomputing (prefill is dense in every arm, so the bytes
are the same). Without that, 100 needle prompts of 7,000 tokens per arm would take hours on two
cores. Timed runs alternate between the arms (round r runs them in order, round r+1 in reverse), so
that every ratio pairs runs seconds apart: on a shared machine one engine's rate moves by 20%
between runs a minute apart, which a ratio of separate medians would carry.

**Speed** (``--contexts``; above SmolLM2's 8,192 trained positions the model runs RoPE-scaled, for
speed only): ``--rows`` concurrent requests of that many tokens, sharing one document (prefix-
cached) and differing in their last 64 tokens, each decoding ``--decode-tokens`` greedy tokens.
Every arm reads each request's whole context: sharing saves prefill, not decode reads.

  decode_tokens_per_s        tokens of all rows between the moment every row has its first
                             token and the moment the first one ends, per second (the median
                             of --repeats timed runs, one per round; runs_tokens_per_s lists them)
  itl_p50_ms / itl_p99_ms    inter-token gaps in that window
  speedup_vs_dense           / dense at the same context: the median over rounds of the ratio of
                             the two arms' runs in that round (paired)
  speedup_vs_bound           / static (first and last blocks, no scoring) at the same kept
                             fraction, paired the same way: what any selection costing nothing
                             would reach here
  selection_share_of_step    the backend's selection seconds (ucm_sparse_selection_seconds)
                             over the run's wall time: scoring, top-k, summary refreshes
  kv_fraction_attended       blocks read / blocks held, dense layers included
  token_agreement_vs_dense   share of the first 32 generated tokens equal to dense's, per row
  step split (dense)         the step at this context vs at --short-context with the same rows:
                             attention = the difference, the rest = the short step; the bound
                             on paper is rest + kv_fraction * attention

**Accuracy** (``--needle-contexts``, native): ``--haystacks`` essay windows x ``--depths``
needle depths spread over 0.05..0.95 ("The special magic number is N." inserted, the question
at the end, the answer's start given); the same prompts for every arm (paired). Per arm: accuracy
with a Wilson 95% interval, per-depth accuracy; against dense: exact McNemar p and Tango's 95%
interval of the paired difference (testing/ucm_testing/stats.py).

JSON summary keys for the default algorithm: decode_speedup_vs_dense_long (longest context),
speedup_vs_bound, selection_share_of_step, needle_paired_trials, needle_diff_lower_95 (longest
needle context), token_agreement_vs_dense (longest native context).

    make bench-deps
    python benchmarks/sparse_serving.py --quick --json OUT.json   # ~25 min on 2 cores

make test's smoke: ``--tiny-model`` (real_model.py) with ``--dense-layers 0``, 1,024-token speed and
needle contexts, 2 rows, 2 needles: the flow, not the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from real_model import (  # benchmarks/ is on sys.path when run as a script
    add_tiny_flag,
    max_positions,
    model_and_text,
    model_label,
    serving_dtype,
)
from variants import parse_variant

from ucm.integration.vllm.config import kv_transfer_config
from ucm_testing.stats import paired, wilson
from ucm_testing.vllm_server import VLLMServer, metric_totals

DEFAULT = "gsa"
RATIO = 0.3
SETTINGS: dict[str, dict[str, Any]] = {
    "gsa": {"sparse_ratio": RATIO},
    "esa": {"sparse_ratio": RATIO},
    "kvstar": {"sparse_ratio": RATIO, "blk_repre_dim_prune_ratio": 0.5},
    "gsa_ondevice": {"sparse_ratio": RATIO},
    "psa": {"eps": 0.95},
    "static": {"sparse_ratio": RATIO},
}
NATIVE = 8192  # SmolLM2's trained positions (main sets it from the model's config: the demo model's 4,096)
QUESTION = "\n\nWhat is the special magic number mentioned in the text above?"
ANSWER_START = "The special magic number is"
AGREEMENT_TOKENS = 32
# vLLM's engine processes poll their shared-memory queues with sched_yield for 1 s after their last
# message: an engine timed right after another ran met 200-400 ms stalls on two cores. Each timed
# run waits this long first.
SETTLE_S = 2.0


class Text:
    """Token ids of the essays and of the chat template around a user message."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        self.tok = tokenizer
        self.ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        marker = "\x00MESSAGE\x00"
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
        )
        before, after = chat.split(marker)
        self.head = self.encode(before)
        self.tail = self.encode(QUESTION + after + ANSWER_START)

    def encode(self, s: str) -> list[int]:
        return self.tok(s, add_special_tokens=False)["input_ids"]

    def window(self, tokens: int, offset: int) -> list[int]:
        start = offset % max(1, len(self.ids) - tokens)
        return self.ids[start : start + tokens]

    def rows(self, tokens: int, rows: int, distinct: bool = False) -> list[list[int]]:
        """``rows`` prompts of ``tokens``: one shared document, a distinct 64-token ending each; or,
        ``distinct``, a document of their own each (nothing shared in the KV cache: each row's
        attention reads memory no other row reads)."""
        if distinct:
            return [self.window(tokens, 1_000_003 * (i + 1)) for i in range(rows)]
        doc = self.window(tokens - 64, 0)
        return [doc + self.window(64, 100_003 + 7919 * i) for i in range(rows)]

    def needle(self, tokens: int, haystack: int, depth: float, number: int) -> list[int]:
        """A chat prompt of ~``tokens``: essays with the needle at ``depth``, the question, the
        answer's start."""
        needle = self.encode(f" The special magic number is {number}. ")
        filler = tokens - len(self.head) - len(self.tail) - len(needle)
        words = self.window(filler, 50_021 * haystack)
        at = int(filler * depth)
        return self.head + words[:at] + needle + words[at:] + self.tail


ENGINE_KNOBS = ("min_tokens", "dense_layers")
CONNECTOR_KNOBS = ("huge_pages",)  # variant options for the connector, any arm's (dense:huge_pages=false)


@dataclass
class Arm:
    name: str  # dense, an algorithm, or a variant of one: "gsa:retrieval_stride=4:sparse_ratio=0.2"
    group: str  # "native" or "scaled": the model configuration
    factor: int  # RoPE scaling factor (1: native)

    @property
    def connector(self) -> dict[str, Any]:
        """The arm's connector options (CONNECTOR_KNOBS of its variant)."""
        return {k: v for k, v in parse_variant(self.name)[1].items() if k in CONNECTOR_KNOBS}

    def sparse(self, knobs: dict[str, Any]) -> dict[str, Any] | None:
        algorithm, options = parse_variant(self.name)
        variant = {k: v for k, v in options.items() if k not in CONNECTOR_KNOBS}
        if algorithm == "dense":
            if variant:
                raise SystemExit(f"--algorithms: {self.name!r}: dense takes connector options only ({CONNECTOR_KNOBS})")
            return None
        if algorithm not in SETTINGS:
            raise SystemExit(f"--algorithms: {algorithm!r} is not one of {', '.join(SETTINGS)}")
        settings = dict(SETTINGS[algorithm])
        if "sparse_ratio" in settings and knobs.get("sparse_ratio") is not None:
            settings["sparse_ratio"] = knobs["sparse_ratio"]
        if "sparse_ratio" in settings and algorithm != "static" and knobs.get("observation_window") is not None:
            settings["observation_window"] = knobs["observation_window"]
        config: dict[str, Any] = {"algorithm": algorithm, algorithm: settings}
        for key in ENGINE_KNOBS:
            if knobs.get(key) is not None:
                config[key] = knobs[key]
        for key, value in variant.items():
            # min_tokens and dense_layers belong to the sparse config, the rest to the algorithm
            (config if key in ENGINE_KNOBS else settings)[key] = value
        return config


def held_tokens(args: argparse.Namespace, contexts: list[int], needles: list[int], factor: int) -> int:
    """Tokens an engine's KV cache must hold at once: a speed run's rows (their shared document once)
    with their endings and decoded tokens, a needle prompt, and vLLM's own minimum (one request of
    the longest length the engine allows)."""
    speed = max(
        (
            (args.rows * c if args.distinct_documents else c + 64 * args.rows) + args.rows * (args.decode_tokens + 2)
            for c in contexts
        ),
        default=0,
    )
    return max(speed, max(needles, default=0), NATIVE * factor)


def kv_cache_gib(model: Path, tokens: int) -> float:
    """GiB, in quarters, that hold ``tokens`` of the model's KV, +25% (at least a quarter: the
    demo model's smoke fits beside another test's engines)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    size = 2 if serving_dtype() == "bfloat16" else 4
    per_token = c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * size  # K and V
    return max(0.25, math.ceil(4 * 1.25 * tokens * per_token / 2**30) / 4)


def check_memory(engines: int, kv_gib: float) -> None:
    """Every arm's engine runs at once: refuse a plan this machine's memory cannot hold (~2.5 GiB per
    engine besides its KV cache, as measured with three 32k engines; that run, with ~1 GiB left free,
    had one engine stall past vLLM's 300 s step limit)."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    need = engines * (kv_gib + 2.5) * 2**30
    if need > available:
        raise SystemExit(
            f"{engines} engines x ({kv_gib} GiB of KV cache + ~2.5 GiB) need {need / 2**30:.0f} GiB, "
            f"{available / 2**30:.0f} GiB are available: fewer --algorithms, --rows or --contexts"
        )


def engine(model: Path, arm: Arm, store: Path, logs: Path, rows: int, kv_gib: float, knobs: dict[str, Any]):
    length = NATIVE * arm.factor
    args = ["--dtype", serving_dtype(), "--max-model-len", str(length), "--max-num-seqs", str(max(16, rows))]
    if knobs.get("block_size") is not None:
        args += ["--block-size", str(knobs["block_size"])]
    if arm.factor > 1:
        rope = {"rope_type": "linear", "factor": float(arm.factor)}
        args += ["--hf-overrides", json.dumps({"rope_scaling": rope, "max_position_embeddings": length})]
    extra: dict[str, Any] = dict(arm.connector)
    sparse = arm.sparse(knobs)
    if sparse is not None:
        extra["sparse"] = sparse
    kv = kv_transfer_config({"spec": "posix", "posix": {"roots": [str(store)]}}, "kv_both", **extra)
    server = VLLMServer(
        model, logs / f"{arm.group}-{arm.name}.log", kv_transfer_config=kv, extra_args=args, kv_cache_gib=kv_gib
    )
    # Workers count the ucm_sparse_* metrics; the API server sums every process's samples from here.
    metrics = logs / f"metrics-{arm.group}-{arm.name}"
    metrics.mkdir()
    server.env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)
    return server


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[list[float], list[str]]:
    """Arrival time and text of each streamed token."""
    times: list[float] = []
    texts: list[str] = []
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    return times, texts


async def run_rows(server: VLLMServer, prompts: list[list[int]], tokens: int) -> list[tuple[list[float], list[str]]]:
    body = {"model": server.model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=7200)) as s:
        return await asyncio.gather(*(stream(s, server.url, {**body, "prompt": p}) for p in prompts))


@dataclass
class Speed:
    tokens_per_s: float  # the median of the timed runs
    runs_tokens_per_s: list[float]
    itl_p50_ms: float
    itl_p99_ms: float
    wall_s: float
    texts: list[list[str]]
    metrics: dict[str, float] = field(default_factory=dict)


def measure_speed(
    servers: dict[str, VLLMServer], prompts: list[list[int]], decode_tokens: int, repeats: int = 1
) -> dict[str, Speed]:
    """``repeats`` rounds, each one timed run per arm (in order, then in reverse the next round): per
    arm the median rate, every rate (their spread says how much this machine's noise moves one
    engine), inter-token gaps pooled; :func:`paired_ratio` compares two arms round by round."""
    # Warm-up, dense first (it computes the document and stores it; the others load it): then every
    # row's prompt is cached and one decode step refreshes the summaries of loaded blocks.
    for server in servers.values():
        asyncio.run(run_rows(server, prompts[:1], 2))
        asyncio.run(run_rows(server, prompts, 2))
    before = {name: metric_totals(server.url) for name, server in servers.items()}
    rates: dict[str, list[float]] = {name: [] for name in servers}
    gaps: dict[str, list[float]] = {name: [] for name in servers}
    wall = dict.fromkeys(servers, 0.0)
    texts: dict[str, list[list[str]]] = {}
    order = list(servers)
    for round_ in range(repeats):
        for name in order if round_ % 2 == 0 else order[::-1]:
            time.sleep(SETTLE_S)
            started = time.perf_counter()
            runs = asyncio.run(run_rows(servers[name], prompts, decode_tokens))
            wall[name] += time.perf_counter() - started
            start = max(t[0] for t, _ in runs)  # every row is decoding from here
            end = min(t[-1] for t, _ in runs)  # until the first one ends
            produced = sum(sum(1 for x in t if start < x <= end) for t, _ in runs)
            rates[name].append(produced / (end - start) if end > start else float("nan"))
            gaps[name] += [(b - a) * 1e3 for t, _ in runs for a, b in itertools.pairwise(t) if start <= a and b <= end]
            texts.setdefault(name, [t for _, t in runs])
    speeds = {}
    for name, server in servers.items():
        after = metric_totals(server.url)
        delta = {
            k: after[k] - before[name].get(k, 0.0) for k in after if k.startswith("ucm_sparse") or k.startswith("vllm:")
        }
        g = sorted(gaps[name])
        speeds[name] = Speed(
            tokens_per_s=statistics.median(rates[name]),
            runs_tokens_per_s=[round(r, 2) for r in rates[name]],
            itl_p50_ms=g[len(g) // 2] if g else float("nan"),
            itl_p99_ms=g[min(len(g) - 1, int(0.99 * len(g)))] if g else float("nan"),
            wall_s=wall[name],
            texts=texts[name],
            metrics=delta,
        )
    return speeds


def paired_ratio(a: Speed, b: Speed) -> float:
    """``a``'s rate over ``b``'s, round by round (the runs of one round are seconds apart), median."""
    return statistics.median(x / y for x, y in zip(a.runs_tokens_per_s, b.runs_tokens_per_s, strict=True))


def agreement(texts: list[list[str]], reference: list[list[str]]) -> float:
    """Share of the first AGREEMENT_TOKENS generated tokens equal to the reference's, over rows."""
    same = total = 0
    for got, want in zip(texts, reference, strict=True):
        n = min(AGREEMENT_TOKENS, len(got), len(want))
        same += sum(a == b for a, b in zip(got[:n], want[:n], strict=True))
        total += n
    return same / total if total else float("nan")


@dataclass(frozen=True)
class Trial:
    context: int
    haystack: int
    depth: float
    number: int


def trials_for(context: int, haystacks: int, depths: int, seed: int) -> list[Trial]:
    rng = random.Random(seed)
    grid = [0.05 + 0.9 * i / max(1, depths - 1) for i in range(depths)]
    out = [Trial(context, h, d, rng.randrange(10_000, 100_000)) for h in range(haystacks) for d in grid]
    # Deepest first within a haystack: each prompt then shares its text up to the needle with the
    # prompt before it (prefix cache and store), so a trial computes only what follows its needle.
    return sorted(out, key=lambda t: (t.haystack, -t.depth))


def needle_outcomes(server: VLLMServer, text: Text, trials: list[Trial]) -> list[bool]:
    body = {"model": server.model, "max_tokens": 8, "temperature": 0}
    out = []
    for t in trials:  # one at a time, in order: each reuses the previous prompt's prefix
        prompt = text.needle(t.context, t.haystack, t.depth, t.number)
        # A long prompt on a loaded 2-core machine can take minutes; the answer, not the time, is measured.
        r = server.post("/v1/completions", {**body, "prompt": prompt}, timeout=900)
        out.append(str(t.number) in r["choices"][0]["text"].replace(",", ""))
    return out


def accuracy_row(arm: str, context: int, trials: list[Trial], outcomes: list[bool], dense: list[bool] | None):
    lo, hi = wilson(sum(outcomes), len(outcomes))
    by_depth: dict[str, list[bool]] = {}
    for t, ok in zip(trials, outcomes, strict=True):
        by_depth.setdefault(f"{t.depth:.2f}", []).append(ok)
    row: dict[str, Any] = {
        "algorithm": arm,
        "context_tokens": context,
        "trials": len(outcomes),
        "accuracy": round(sum(outcomes) / len(outcomes), 4),
        "accuracy_95": [round(lo, 4), round(hi, 4)],
        "by_depth": {d: round(sum(v) / len(v), 3) for d, v in sorted(by_depth.items())},
        # per trial, in order ("1": found): the same trials in every arm, so any two arms can be paired
        "outcomes": "".join("1" if ok else "0" for ok in outcomes),
    }
    if dense is not None:
        p = paired(dense, outcomes)
        row |= {
            "lost_vs_dense": p.only_first,
            "gained_vs_dense": p.only_second,
            "mcnemar_p": round(p.mcnemar_p, 4),
            "diff_vs_dense": round(p.difference, 4),
            "diff_95": [round(p.difference_interval[0], 4), round(p.difference_interval[1], 4)],
        }
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="dense, static and the default algorithm; fewer trials")
    p.add_argument(
        "--algorithms",
        help=f"comma-separated, from {', '.join(SETTINGS)} (default: all); a variant adds options after the "
        "name, e.g. gsa:retrieval_stride=4 or esa:dense_layers=0, or a connector option to any arm, e.g. "
        "dense:huge_pages=false (arms side by side in one run; such an arm is measured against dense and static "
        "with the same connector options when the run has them)",
    )
    p.add_argument("--contexts", help="speed contexts (default 2000,7000,16000,32000)")
    p.add_argument("--needle-contexts", help="accuracy contexts, native (default 2000,7000; quick: 7000)")
    p.add_argument("--rows", type=int, default=8, help="concurrent requests in a speed run")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per speed row (the median is reported)")
    p.add_argument("--short-context", type=int, default=256, help="the dense step's non-attention reference")
    p.add_argument("--haystacks", type=int, help="essay windows per needle context (default 4; quick 2)")
    p.add_argument("--depths", type=int, help="needle depths per haystack (default 25; quick 20)")
    p.add_argument("--min-tokens", type=int, help="sparse from this length (default: the engine's default)")
    p.add_argument("--sparse-ratio", type=float, help=f"share of blocks the top-k algorithms keep (default {RATIO})")
    p.add_argument("--dense-layers", type=int, help="first layers kept dense (default: the engine's default)")
    p.add_argument("--block-size", type=int, help="vLLM's KV block size, the unit of selection (default 128 on CPU)")
    p.add_argument(
        "--distinct-documents",
        action="store_true",
        help="speed rows read documents of their own (default: one shared document, distinct endings)",
    )
    p.add_argument(
        "--observation-window",
        type=int,
        help="the top-k algorithms' observation_window: last prompt tokens whose attention is kept as a prior",
    )
    p.add_argument(
        "--kv-cache-gib", type=float, help="each engine's KV cache (default: what the longest row set needs, +25%%)"
    )
    add_tiny_flag(p)  # the demo model has 2 layers: --dense-layers 0 makes them sparse
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    speeds = args.contexts if args.contexts is not None else "2000,7000,16000,32000"
    contexts = [int(c) for c in speeds.split(",") if c]
    algorithms = (args.algorithms or (f"{DEFAULT},static" if args.quick else ",".join(SETTINGS))).split(",")
    if contexts and "static" not in algorithms:  # the speed runs' bound; needles need none
        algorithms.append("static")
    arms = ["dense", *algorithms]
    if len(set(arms)) != len(arms):
        raise SystemExit(f"--algorithms: an arm is named twice in {', '.join(arms)}")
    needles = args.needle_contexts if args.needle_contexts is not None else ("7000" if args.quick else "2000,7000")
    needle_contexts = [int(c) for c in needles.split(",") if c]
    haystacks = args.haystacks or (2 if args.quick else 4)
    depths = args.depths or (20 if args.quick else 25)
    from transformers import AutoTokenizer

    global NATIVE
    model, essays = model_and_text(args.tiny_model)
    NATIVE = max_positions(model)
    text = Text(AutoTokenizer.from_pretrained(model), essays)
    knobs = {
        "min_tokens": args.min_tokens,
        "sparse_ratio": args.sparse_ratio,
        "dense_layers": args.dense_layers,
        "block_size": args.block_size,
        "observation_window": args.observation_window,
    }
    work = Path(tempfile.mkdtemp(prefix="sparse-serving-"))
    print(f"logs under {work} (each store is removed when its engines are done: GBs at 32k)", flush=True)
    groups = {"native": 1, "scaled": max(1, math.ceil((max(contexts, default=0) + 256) / NATIVE))}
    speed_rows: list[dict[str, Any]] = []
    accuracy_rows: list[dict[str, Any]] = []
    dense_short: dict[str, Speed] = {}
    dense_needles: dict[int, list[bool]] = {}
    trials = {c: trials_for(c, haystacks, depths, seed=c) for c in needle_contexts}
    for group, factor in groups.items():
        group_contexts = [c for c in contexts if (c + 256 <= NATIVE) == (group == "native")]
        group_needles = needle_contexts if group == "native" else []
        if not group_contexts and not group_needles:
            continue
        kv_gib = args.kv_cache_gib or kv_cache_gib(model, held_tokens(args, group_contexts, group_needles, factor))
        check_memory(len(arms), kv_gib)
        store = work / f"store-{group}"
        store.mkdir()
        servers: dict[str, VLLMServer] = {}
        try:
            for name in arms:
                arm = Arm(name, group, factor)
                servers[name] = engine(model, arm, store, work, args.rows, kv_gib, knobs).start()
            for server in servers.values():
                server.wait_ready(900)
            if group_contexts:
                short_rows = text.rows(args.short_context, args.rows)
                dense = {"dense": servers["dense"]}
                dense_short[group] = measure_speed(dense, short_rows, args.decode_tokens, args.repeats)["dense"]
            for context in group_contexts:
                prompts = text.rows(context, args.rows, args.distinct_documents)
                speeds = measure_speed(servers, prompts, args.decode_tokens, args.repeats)
                for name, s in speeds.items():
                    row = speed_row(name, group, context, args.rows, s, speeds)
                    if name == "dense":
                        row |= step_split(s, dense_short[group], args.rows)
                    speed_rows.append(row)
                    print(format_speed(row), flush=True)
            for context in group_needles:
                for name in arms:  # dense first: the reference
                    if name == "static" and args.quick:
                        continue
                    outcomes = needle_outcomes(servers[name], text, trials[context])
                    if name == "dense":
                        dense_needles[context] = outcomes
                    reference = dense_needles[context] if name != "dense" else None
                    row = accuracy_row(name, context, trials[context], outcomes, reference)
                    accuracy_rows.append(row)
                    print(format_accuracy(row), flush=True)
        finally:
            for server in servers.values():
                server.stop()
            shutil.rmtree(store)
    report = summarize(speed_rows, accuracy_rows, algorithms, contexts, needle_contexts)
    report["setup"] = {
        "model": f"{model_label(args.tiny_model)} ({serving_dtype()})",
        "rows": args.rows,
        "decode_tokens": args.decode_tokens,
        "rounds": args.repeats,  # each times every arm once; ratios are medians of per-round ratios
        "scaled_rope_factor": groups["scaled"],
        "block_size": args.block_size or "vLLM's default",
        "documents": "one per row" if args.distinct_documents else "one shared by the rows",
        "haystacks": haystacks,
        "depths": depths,
        "settings": {a: Arm(a, "native", 1).sparse(knobs) for a in algorithms},
    }
    show(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def speed_row(name: str, group: str, context: int, rows: int, s: Speed, arms: dict[str, Speed]) -> dict[str, Any]:
    m = s.metrics
    available = m.get("ucm_sparse_blocks_available_total", 0.0)
    selection = m.get("ucm_sparse_selection_seconds_sum", 0.0)
    row: dict[str, Any] = {
        "algorithm": name,
        "model": group,
        "context_tokens": context,
        "rows": rows,
        "decode_tokens_per_s": round(s.tokens_per_s, 2),
        "runs_tokens_per_s": s.runs_tokens_per_s,
        "itl_p50_ms": round(s.itl_p50_ms, 2),
        "itl_p99_ms": round(s.itl_p99_ms, 2),
        "kv_fraction_attended": round(m.get("ucm_sparse_blocks_attended_total", 0.0) / available, 3)
        if available
        else 1.0,
        "selection_share_of_step": round(selection / s.wall_s, 4),
    }
    algorithm = parse_variant(name)[0]
    dense, static = counterpart("dense", name, arms), counterpart("static", name, arms)
    if algorithm != "dense":
        row["speedup_vs_dense"] = round(paired_ratio(s, arms[dense]), 3)
        row["token_agreement_vs_dense"] = round(agreement(s.texts, arms[dense].texts), 3)
    if algorithm not in ("dense", "static") and static in arms:
        row["speedup_vs_bound"] = round(paired_ratio(s, arms[static]), 3)
    return row


def counterpart(base: str, name: str, arms: dict[str, Any]) -> str:
    """The arm ``name`` is measured against as ``base`` (dense, static): the one with the same connector
    options when the run has it (gsa:huge_pages=false against static:huge_pages=false), else ``base``."""
    options = [o for o in name.split(":")[1:] if o.partition("=")[0] in CONNECTOR_KNOBS]
    twin = ":".join([base, *options])
    return twin if twin in arms else base


def step_split(long: Speed, short: Speed, rows: int) -> dict[str, Any]:
    """A dense step at this context against one at a short context, same rows: attention is the
    difference."""
    step = rows / long.tokens_per_s * 1e3
    rest = rows / short.tokens_per_s * 1e3
    return {
        "dense_step_ms": round(step, 2),
        "dense_attention_ms": round(step - rest, 2),
        "dense_rest_ms": round(rest, 2),
    }


def summarize(
    speed: list[dict[str, Any]],
    accuracy: list[dict[str, Any]],
    algorithms: list[str],
    contexts: list[int],
    needle_contexts: list[int],
) -> dict[str, Any]:
    by = {(r["algorithm"], r["context_tokens"]): r for r in speed}
    for r in speed:
        dense = by.get(("dense", r["context_tokens"]))
        if dense is not None and "dense_attention_ms" in dense and r["algorithm"] != "dense":
            predicted = dense["dense_rest_ms"] + r["kv_fraction_attended"] * dense["dense_attention_ms"]
            r["bound_on_paper_speedup"] = round(dense["dense_step_ms"] / predicted, 3)
    default = DEFAULT if DEFAULT in algorithms else algorithms[0]
    longest = max(contexts, default=None)
    native = max([c for c in contexts if c + 256 <= NATIVE], default=None)
    mine = by.get((default, longest), {})
    report: dict[str, Any] = {"speed": speed, "accuracy": accuracy, "default": default}
    report["decode_speedup_vs_dense_long"] = mine.get("speedup_vs_dense")
    report["speedup_vs_bound"] = mine.get("speedup_vs_bound")
    report["selection_share_of_step"] = mine.get("selection_share_of_step")
    report["token_agreement_vs_dense"] = by.get((default, native), {}).get("token_agreement_vs_dense")
    acc = [r for r in accuracy if r["algorithm"] == default and r["context_tokens"] == max(needle_contexts, default=0)]
    if acc:
        report["needle_paired_trials"] = acc[0]["trials"]
        report["needle_diff_lower_95"] = acc[0]["diff_95"][0]
        report["needle_mcnemar_p"] = acc[0]["mcnemar_p"]
    report["slower_than_dense_at_2k"] = [
        r["algorithm"] for r in speed if r["context_tokens"] <= 2048 and r.get("speedup_vs_dense", 1.0) < 0.97
    ]
    return report


def format_speed(r: dict[str, Any]) -> str:
    extra = "".join(
        f", {k} {r[k]}" for k in ("speedup_vs_dense", "token_agreement_vs_dense", "dense_attention_ms") if k in r
    )
    return (
        f"{r['algorithm']:>12} {r['context_tokens']:>6} x{r['rows']}: {r['decode_tokens_per_s']:>8} tok/s "
        f"(runs {r['runs_tokens_per_s']}), "
        f"ITL p50 {r['itl_p50_ms']} ms p99 {r['itl_p99_ms']} ms, KV read {r['kv_fraction_attended']}, "
        f"selection {r['selection_share_of_step']:.1%}{extra}"
    )


def format_accuracy(r: dict[str, Any]) -> str:
    s = f"{r['algorithm']:>12} {r['context_tokens']:>6} needles: {r['accuracy']:.3f} {r['accuracy_95']}"
    s += f" (n={r['trials']})"
    if "diff_95" in r:
        s += f", vs dense {r['diff_vs_dense']:+.3f} {r['diff_95']}, lost {r['lost_vs_dense']} gained "
        s += f"{r['gained_vs_dense']}, McNemar p {r['mcnemar_p']}"
    return s


def show(report: dict[str, Any]) -> None:
    print(
        f"\n{'algorithm':>12} {'tokens':>6} {'tok/s':>8} {'vs dense':>8} {'vs bound':>8} {'paper':>6} "
        f"{'select':>7} {'KV read':>7} {'agree':>6} {'ITL p50':>8} {'p99':>8}"
    )
    for r in report["speed"]:
        print(
            f"{r['algorithm']:>12} {r['context_tokens']:>6} {r['decode_tokens_per_s']:>8} "
            f"{r.get('speedup_vs_dense', ''):>8} {r.get('speedup_vs_bound', ''):>8} "
            f"{r.get('bound_on_paper_speedup', ''):>6} {r['selection_share_of_step']:>7.1%} "
            f"{r['kv_fraction_attended']:>7} {r.get('token_agreement_vs_dense', ''):>6} {r['itl_p50_ms']:>8} "
            f"{r['itl_p99_ms']:>8}"
        )
    for r in report["accuracy"]:
        print(format_accuracy(r))
        print(f"{'':>12} by depth: {r['by_depth']}")
    keys = (
        "decode_speedup_vs_dense_long",
        "speedup_vs_bound",
        "selection_share_of_step",
        "needle_paired_trials",
        "needle_diff_lower_95",
        "needle_mcnemar_p",
        "token_agreement_vs_dense",
        "slower_than_dense_at_2k",
    )
    print(f"\n{report['default']}: " + ", ".join(f"{k} {report.get(k)}" for k in keys))


if __name__ == "__main__":
    sys.exit(main())
