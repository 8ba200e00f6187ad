"""Routing policies on one multi-tenant chat trace, against real engines that evict (issue 36).

Two vLLM engines (SmolLM2-135M-Instruct, one core each) with small KV caches
(``--num-gpu-blocks-override``: they must evict), publishing their KV events, behind ucm-proxy in
``mixed`` mode. Every policy gets the same trace, from cold caches (``/reset_prefix_cache``
between policies) and a fresh proxy:

  tenants        ``--tenants`` system prompts (~``--system-chars`` of essay text each, after a
                 preamble of ``--preamble-chars`` they all share), chosen by Zipf(``--zipf``)
                 popularity
  conversations  a tenant's system prompt, then turns: a user message (~``--user-chars``), the
                 answer (``--answer-tokens``, greedy, discarded) and a fixed assistant text (so
                 that the trace does not depend on what an engine generated)
  phases         ``uniform`` (Zipf), then ``hot``: one unpopular tenant takes ``--hot-share`` of the
                 new conversations
  clients        ``--clients`` at once, each running conversations one after another

Per policy: prompt tokens and those served from an engine's prefix cache (vLLM's own
``prefix_cache_queries``/``hits`` counters, summed over the engines), the hit rate; with
``--store`` (both engines on one POSIX store through the UCM connector, emptied between policies)
the tokens loaded from the store and those recomputed; load imbalance
in the hot phase (the engines' time-averaged outstanding requests, sampled from the proxy's
``ucm_proxy_backend_in_flight``: max / mean), TTFT p50/p99. And an **oracle**: the kv_aware run's
requests, in their arrival order, replayed in a simulation of two LRU caches of the engines'
capacity where every request goes to the engine holding its longest cached prefix — what perfect
knowledge of the caches hits, with no regard for load (the ceiling for two caches; vLLM frees
blocks in nearly LRU order, so a policy can land a little above it), and the same with one cache of
both engines' size (``pooled``: about what no split between engines can beat).

    python benchmarks/routing.py --quick --json OUT.json

make test's smoke: ``--tiny-model`` (real_model.py), 3 tenants, 2 conversations of 2 turns per
phase, ``--store``: the flow, not the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from real_model import add_tiny_flag, model_and_text, model_label, serving_dtype  # benchmarks/ is on sys.path

from ucm.deploy.ports import free_port
from ucm.integration.vllm.config import kv_transfer_config
from ucm_testing.processes import stop_process
from ucm_testing.vllm_server import VLLMServer

POLICIES = ("round_robin", "least_outstanding", "prefix_affinity", "kv_aware")
BLOCK = 32
ASSISTANT = "I see. Please go on, and tell me more about that part."


@dataclass(frozen=True)
class Conversation:
    tenant: int
    phase: str
    users: tuple[str, ...]


def build_trace(args: argparse.Namespace, text: str) -> tuple[list[str], list[Conversation]]:
    rng = random.Random(7)
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
    # A preamble every tenant's prompt starts with (shared instructions, tool definitions): what
    # prefix_affinity hashes when it is longer than routing.prefix_chars.
    preamble = text[len(text) // 2 : len(text) // 2 + args.preamble_chars]
    system = []
    for t in range(args.tenants):
        start = t * len(text) // args.tenants
        system.append(
            f"{preamble}\nYou are tenant {t}'s assistant. Their handbook:\n{text[start : start + args.system_chars]}"
        )
    weights = [1 / (r + 1) ** args.zipf for r in range(args.tenants)]
    hot = args.tenants - 1  # the least popular becomes hot

    def conversation(tenant: int, phase: str) -> Conversation:
        users = tuple(rng.choice(paragraphs)[: args.user_chars] for _ in range(args.turns))
        return Conversation(tenant, phase, users)

    conversations = [
        conversation(rng.choices(range(args.tenants), weights)[0], "uniform") for _ in range(args.conversations)
    ]
    for _ in range(args.conversations):
        tenant = hot if rng.random() < args.hot_share else rng.choices(range(args.tenants), weights)[0]
        conversations.append(conversation(tenant, "hot"))
    return system, conversations


def messages(system: str, users: tuple[str, ...], turn: int) -> list[dict[str, str]]:
    out = [{"role": "system", "content": system}]
    for i in range(turn + 1):
        out.append({"role": "user", "content": users[i]})
        if i < turn:
            out.append({"role": "assistant", "content": ASSISTANT})
    return out


async def ask(http: aiohttp.ClientSession, url: str, model: str, msgs: list[dict[str, str]], answer: int):
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": answer,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    first = None
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if first is None and line.startswith("data: {") and '"content":"' in line:
                first = time.perf_counter()
    return (first or time.perf_counter()) - t0


class InFlightSampler:
    """The proxy's in-flight requests per backend, sampled every 50 ms while ``on``."""

    def __init__(self, proxy_url: str) -> None:
        self.url = proxy_url
        self.samples: dict[str, list[float]] = {}
        self.on = False

    async def run(self, http: aiohttp.ClientSession) -> None:
        prefix = 'ucm_proxy_backend_in_flight{backend="'
        while True:
            if self.on:
                async with http.get(self.url + "/metrics") as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith(prefix):
                            backend = line[len(prefix) :].split('"', 1)[0]
                            self.samples.setdefault(backend, []).append(float(line.rsplit(" ", 1)[1]))
            await asyncio.sleep(0.05)

    def imbalance(self) -> float:
        means = [statistics.fmean(v) for v in self.samples.values() if v]
        if not means or statistics.fmean(means) == 0:
            return float("nan")
        return max(means) / statistics.fmean(means)


async def replay(
    proxy_url: str,
    model: str,
    system: list[str],
    trace: list[Conversation],
    args: argparse.Namespace,
    engines: list[VLLMServer],
) -> dict[str, Any]:
    """The trace through the proxy: each phase's conversations over ``clients`` clients. Returns the
    engines' counters at each phase's start and the index of its first arrival, so that the hot
    phase's hits can be told apart."""
    ttfts: list[float] = []
    arrivals: list[list[dict[str, str]]] = []
    starts: dict[str, tuple[tuple[float, float, float], int]] = {}
    sampler = InFlightSampler(proxy_url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        sampling = asyncio.create_task(sampler.run(http))
        try:
            for phase in ("uniform", "hot"):
                queue = [c for c in trace if c.phase == phase]
                sampler.on = phase == "hot"
                starts[phase] = (counters(engines), len(arrivals))  # no request in flight between phases

                async def client(queue: list[Conversation] = queue) -> None:
                    while queue:
                        c = queue.pop(0)
                        for turn in range(len(c.users)):
                            msgs = messages(system[c.tenant], c.users, turn)
                            arrivals.append(msgs)
                            ttfts.append(await ask(http, proxy_url, model, msgs, args.answer_tokens))

                await asyncio.gather(*(client() for _ in range(args.clients)))
        finally:
            sampling.cancel()
    return {"ttfts": ttfts, "arrivals": arrivals, "imbalance_hot": sampler.imbalance(), "starts": starts}


def counters(engines: list[VLLMServer]) -> tuple[float, float, float]:
    """Prompt tokens the engines looked up in their prefix caches, found there, and loaded from the
    store (the UCM connector's count), summed over the engines."""
    queries = hits = loaded = 0.0
    for e in engines:
        m = e.metrics()
        queries += m.get("vllm:prefix_cache_queries_total", 0.0)
        hits += m.get("vllm:prefix_cache_hits_total", 0.0)
        loaded += m.get("ucm_connector_external_hit_tokens_total", 0.0)
    return queries, hits, loaded


def empty_store(root: Path) -> None:
    """Every block of a POSIX store gone (its 256 shard directories; it recreates them on write)."""
    for shard in root.iterdir():
        if shard.is_dir() and len(shard.name) == 2:
            shutil.rmtree(shard, ignore_errors=True)


def start_proxy(engines: list[VLLMServer], policy: str, events: dict[str, dict[str, str]], work: Path):
    port = free_port()
    config = {
        "host": "127.0.0.1",
        "port": port,
        "mode": "mixed",
        "decode": [e.url for e in engines],
        "routing": {"decode": policy, "kv_events": {"endpoints": events}},
        "health": {"interval_s": 1},
    }
    path = work / f"proxy-{policy}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(work / f"proxy-{policy}.log", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("ucm-proxy")), "--config", str(path)], stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the proxy did not start; see {work / f'proxy-{policy}.log'}")
        time.sleep(0.2)


def block_keys(tokens: list[int]) -> list[bytes]:
    keys, parent = [], b""
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.blake2b(parent + json.dumps(tokens[i * BLOCK : (i + 1) * BLOCK]).encode()).digest()
        keys.append(parent)
    return keys


def oracle_hits(prompts: list[list[int]], engines: int, capacity: int) -> list[int]:
    """Each prompt's hit tokens in two LRU caches of ``capacity`` blocks when each prompt goes where
    its longest prefix is cached (vLLM computes at least a prompt's last token: a full hit stops one
    block short)."""
    caches: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(engines)]
    hits = []
    for n, tokens in enumerate(prompts):
        keys = block_keys(tokens)
        usable = (len(tokens) - 1) // BLOCK

        def held(cache: OrderedDict[bytes, None], keys: list[bytes] = keys) -> int:
            return next((i for i, k in enumerate(keys) if k not in cache), len(keys))

        best = max(range(engines), key=lambda e: (held(caches[e]), -((n + e) % engines)))
        hits.append(min(held(caches[best]), usable) * BLOCK)
        cache = caches[best]
        for k in keys:
            cache.pop(k, None)
            cache[k] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer conversations (~6 min)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--tenants", type=int, default=10)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--system-chars", type=int, default=2400, help="~600 tokens")
    ap.add_argument(
        "--preamble-chars", type=int, default=0, help="shared by every tenant's system prompt, before its own part"
    )
    ap.add_argument("--user-chars", type=int, default=240)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=None, help="per phase (default 40; --quick 20)")
    ap.add_argument("--hot-share", type=float, default=0.6)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--cache-blocks", type=int, default=160, help=f"per engine, of {BLOCK} tokens")
    ap.add_argument(
        "--store", action="store_true", help="both engines with the UCM connector on one POSIX store (a load tier)"
    )
    add_tiny_flag(ap)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.conversations = args.conversations or (20 if args.quick else 40)
    policies = [p for p in args.policies.split(",") if p]
    model, text = model_and_text(args.tiny_model)
    system, trace = build_trace(args, text)
    work = Path(tempfile.mkdtemp(prefix="ucm-routing-"))
    print(f"logs under {work}", flush=True)
    engines, events = [], {}
    store = work / "store"
    store.mkdir()
    kv = kv_transfer_config({"spec": "posix", "posix": {"roots": [str(store)]}}, "kv_both") if args.store else None
    for core in ("0", "1"):
        port = free_port()
        replay_port = free_port(taken=[port])
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": "kv-events",
        }
        extra = ["--num-gpu-blocks-override", str(args.cache_blocks), "--kv-events-config", json.dumps(config)]
        extra += [
            "--dtype",
            serving_dtype(),
            "--max-model-len",
            str(min(2048, (args.cache_blocks - 1) * BLOCK)),
            "--served-model-name",
            "smollm2",
        ]
        engine = VLLMServer(
            model, work / f"engine-{core}.log", kv_transfer_config=kv, extra_args=extra, threads_bind=core
        )
        engine.env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between policies
        engines.append(engine)
        events[engine.url] = {"events": f"tcp://127.0.0.1:{port}", "replay": f"tcp://127.0.0.1:{replay_port}"}
    rows: list[dict[str, Any]] = []
    arrivals: list[list[dict[str, str]]] = []
    hot_start = 0
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready(600)
        for policy in policies:
            for e in engines:  # every policy from cold caches
                request = urllib.request.Request(e.url + "/reset_prefix_cache", method="POST")
                urllib.request.urlopen(request, timeout=30).close()
            if args.store:
                empty_store(store)
            proc, url = start_proxy(engines, policy, events, work)
            try:
                run = asyncio.run(replay(url, "smollm2", system, trace, args, engines))
                q1, h1, l1 = counters(engines)
            finally:
                stop_process(proc, grace_s=5)
            (q0, h0, l0), _ = run["starts"]["uniform"]
            (qh, hh, _), first_hot = run["starts"]["hot"]
            if policy == "kv_aware":
                arrivals, hot_start = run["arrivals"], first_hot
            row = {
                "policy": policy,
                "requests": len(run["ttfts"]),
                "prompt_tokens": q1 - q0,
                "hit_tokens": h1 - h0,
                "hit_rate": (h1 - h0) / max(1.0, q1 - q0),
                "hot_prompt_tokens": q1 - qh,
                "hot_hit_tokens": h1 - hh,
                "store_loaded_tokens": l1 - l0,
                "recomputed_tokens": (q1 - q0) - (h1 - h0) - (l1 - l0),
                "imbalance_hot": run["imbalance_hot"],
                "ttft_p50_s": percentile(run["ttfts"], 0.5),
                "ttft_p99_s": percentile(run["ttfts"], 0.99),
            }
            rows.append(row)
            print(
                f"{policy:18} hit {row['hit_tokens']:8.0f}/{row['prompt_tokens']:8.0f} ({row['hit_rate']:.2f}) "
                f"hot phase {row['hot_hit_tokens']:8.0f}/{row['hot_prompt_tokens']:8.0f} "
                f"store {row['store_loaded_tokens']:7.0f} "
                f"imbalance {row['imbalance_hot']:.2f} ttft p50 {row['ttft_p50_s'] * 1e3:.0f} ms "
                f"p99 {row['ttft_p99_s'] * 1e3:.0f} ms",
                flush=True,
            )
        oracle = pooled = None
        if arrivals:
            prompts = [engines[0].post("/tokenize", {"model": "smollm2", "messages": m})["tokens"] for m in arrivals]
            per_prompt = oracle_hits(prompts, len(engines), args.cache_blocks)
            oracle = {"all": sum(per_prompt), "hot": sum(per_prompt[hot_start:])}
            pooled_per_prompt = oracle_hits(prompts, 1, len(engines) * args.cache_blocks)
            pooled = {"all": sum(pooled_per_prompt), "hot": sum(pooled_per_prompt[hot_start:])}
            print(
                f"{'oracle':18} hit {oracle['all']:8.0f} hot phase {oracle['hot']:8.0f} "
                f"(one cache of both engines' size: {pooled['all']:.0f}, hot phase {pooled['hot']:.0f})",
                flush=True,
            )
    finally:
        for e in engines:
            e.stop()
        shutil.rmtree(store, ignore_errors=True)  # the logs stay
    report = summarize(rows, oracle, pooled)
    report["setup"] = {
        "model": f"{model_label(args.tiny_model)} ({serving_dtype()}), 2 engines, one core each",
        "cache_blocks_per_engine": args.cache_blocks,
        "block_size": BLOCK,
        "tenants": args.tenants,
        "preamble_chars": args.preamble_chars,
        "zipf": args.zipf,
        "conversations_per_phase": args.conversations,
        "turns": args.turns,
        "hot_share": args.hot_share,
        "clients": args.clients,
        "store": "one POSIX store behind both engines (UCM connector)" if args.store else None,
    }
    print(json.dumps(report["summary"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def summarize(
    rows: list[dict[str, Any]], oracle: dict[str, int] | None, pooled: dict[str, int] | None
) -> dict[str, Any]:
    """The issue's figures over the whole trace and, suffixed ``_hot``, over the hot (skewed) phase."""
    by = {r["policy"]: r for r in rows}
    kv, affinity = by.get("kv_aware"), by.get("prefix_affinity")
    summary: dict[str, Any] = {}
    for suffix, hits in (("", "hit_tokens"), ("_hot", "hot_hit_tokens")):
        phase = "hot" if suffix else "all"
        ceiling = oracle[phase] if oracle else None
        summary[f"oracle_hit_tokens{suffix}"] = ceiling
        summary[f"pooled_cache_hit_tokens{suffix}"] = pooled[phase] if pooled else None
        if affinity is not None and ceiling:
            summary[f"oracle_vs_affinity{suffix}"] = ceiling / max(1.0, affinity[hits])
        if kv is not None:
            if ceiling:
                summary[f"kv_aware_hit_tokens_vs_oracle{suffix}"] = kv[hits] / ceiling
            if affinity is not None and affinity[hits]:
                summary[f"kv_aware_hit_tokens_vs_affinity{suffix}"] = kv[hits] / affinity[hits]
    if kv is not None:
        summary["kv_aware_imbalance"] = kv["imbalance_hot"]
        if affinity is not None:
            summary["kv_aware_ttft_p50_vs_affinity"] = kv["ttft_p50_s"] / affinity["ttft_p50_s"]
    return {"summary": summary, "policies": rows}


if __name__ == "__main__":
    sys.exit(main())
