"""Sparse attention quality and cost on long contexts: KV attended vs error and mass recall.

Two cases. **real**: Q, K and V captured from a pretrained model (SmolLM2-135M-Instruct, see
benchmarks/real_model.py) reading long real text (Paul Graham's essays): the last positions of a
long window, in layers spread over the model. **synthetic**: a generator, fixed below and never tuned
per algorithm, shaped like long-context attention:

- keys: small Gaussian noise; a sink direction on the first 4 tokens; a retrieval direction on 3
  random blocks per KV head; and "recency" features: for length scales of 256..8192 tokens, a
  direction weighted by exp(-distance from the end / scale), so recent tokens look alike;
- queries: the sink and retrieval directions plus recency features of one band of length scales,
  drawn per (head, query): short scales give a narrow local window, long ones a wide one. The
  bands are set so that reaching 95% of the attention mass takes < 50 blocks for about 20% of
  (head, query) pairs, 50-100 for about 60% and > 100 for about 20% (the PSA paper's observation).
  The benchmark prints that distribution.

Algorithms see only Q, K, V and block metadata; the true attention mass is used only to score.
Per algorithm: fraction of KV blocks attended, output relative error, attention-mass recall, and
CPU time next to dense attention. PSA vs fixed top-k (the same block order, one fraction for
everything): the smallest top-k fraction and the smallest PSA eps whose mean recall reaches 98%
(and 95%), and the ratio of their mean KV fractions.

    python benchmarks/sparse_eval.py --quick --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ucm.sparse.base import BlockMeta, BlockSelector, PagedKV, attention_mass, dense_attention
from ucm.sparse.esa import ESA, ESAConfig
from ucm.sparse.gsa import GSA, GSAConfig
from ucm.sparse.gsa_ondevice import GSAOnDevice, GSAOnDeviceConfig
from ucm.sparse.kvstar import KVStar, KVStarConfig
from ucm.sparse.psa import PSA, PSAConfig

BLOCK = 32
# The generator, fixed: recency length scales (tokens), and per band (share of (head, query)
# pairs, the scales its queries weight).
SCALES = (256, 512, 1024, 2048, 4096, 8192)
BANDS = ((0.2, (256, 512)), (0.6, (2048, 4096)), (0.2, (8192,)))
SHARPNESS = 12.0  # query norm: how peaked attention is over the structure
RECENCY = 4.0  # amplitude of the recency features in keys


@dataclass
class Case:
    q: torch.Tensor  # (H, D)
    kv: PagedKV
    mass: torch.Tensor  # (Hkv, n) true attention mass per block (evaluation only)
    dense: torch.Tensor  # (H, D)
    dense_s: float


def generate(layers: int, queries: int, tokens: int, hkv: int, g: int, d: int, seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    cases = []
    h = hkv * g
    distance = (tokens - 1 - torch.arange(tokens)).float()
    for _ in range(layers):
        dirs = _orthonormal(hkv, 2 + len(SCALES), d, gen)  # (Hkv, 2 + S, D): sink, retrieval, scales
        sink, retrieval, recency = dirs[:, 0], dirs[:, 1], dirs[:, 2:]
        keys = 0.3 * torch.randn(tokens, hkv, d, generator=gen)
        keys[:4] += 3.0 * sink
        for head in range(hkv):
            for blk in torch.randperm(tokens // BLOCK, generator=gen)[:3]:
                keys[blk * BLOCK : (blk + 1) * BLOCK, head] += 1.5 * retrieval[head]
        weights = torch.stack([torch.exp(-distance / s) for s in SCALES], 1)  # (N, S)
        keys += RECENCY * torch.einsum("ns,hsd->nhd", weights, recency)
        values = torch.randn(tokens, hkv, d, generator=gen)
        kv = PagedKV.from_dense(keys, values, BLOCK)
        for _ in range(queries):
            q = torch.empty(h, d)
            for head in range(h):
                kvh = head // g
                band = _band(gen)
                mix = torch.tensor([1.0 if s in band else 0.0 for s in SCALES])
                direction = 0.3 * sink[kvh] + 0.25 * retrieval[kvh] + (mix[:, None] * recency[kvh]).sum(0)
                direction += 0.05 * torch.randn(d, generator=gen)
                q[head] = _unit(direction) * SHARPNESS
            t0 = time.perf_counter()
            dense = dense_attention(q, kv)
            dense_s = time.perf_counter() - t0
            cases.append(Case(q, kv, attention_mass(q, kv), dense, dense_s))
    return cases


def _band(gen: torch.Generator) -> tuple[int, ...]:
    u = torch.rand(1, generator=gen).item()
    for share, band in BANDS:
        if u < share:
            return band
        u -= share
    return BANDS[-1][1]


def _orthonormal(hkv: int, k: int, d: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(hkv, d, k, generator=gen))
    return q.transpose(1, 2)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def blocks_for_mass(q: torch.Tensor, kv: PagedKV, target: float) -> list[int]:
    """Per query head, the fewest blocks holding ``target`` of its attention mass."""
    hkv, d = kv.keys.shape[2], kv.keys.shape[3]
    g = q.shape[0] // hkv
    keys = kv.keys.view(-1, hkv, d)[: kv.num_tokens]
    out = []
    for head in range(q.shape[0]):
        p = torch.softmax(keys[:, head // g] @ q[head] / math.sqrt(d), 0)
        per_block = torch.nn.functional.pad(p, (0, kv.num_blocks * BLOCK - kv.num_tokens)).view(-1, BLOCK).sum(-1)
        cum = per_block.sort(descending=True).values.cumsum(0)
        out.append(int((cum < target).sum()) + 1)
    return out


def evaluate(name: str, cases: list[Case], make: Callable[[], BlockSelector]) -> dict[str, Any]:
    """Mean KV fraction, relative error, mass recall and time vs dense of one configuration."""
    rows = []
    for case in cases:
        algo = make()
        meta = BlockMeta.of(case.kv)
        t0 = time.perf_counter()
        out, used = algo.attend(case.q, case.kv, meta)
        secs = time.perf_counter() - t0
        rows.append(
            {
                "kv_fraction": float(used.float().mean()) / case.kv.num_blocks,
                "rel_error": float((out - case.dense).norm() / case.dense.norm()),
                "recall": attended_mass(algo, case),
                "time_vs_dense": secs / case.dense_s,
            }
        )
    return _mean(name, rows)


def attended_mass(algo: BlockSelector, case: Case) -> float:
    """The true attention mass of the blocks an algorithm attended, mean over KV heads."""
    return float(torch.stack([case.mass[h][blocks].sum() for h, blocks in enumerate(algo.last_blocks)]).mean())


def _mean(name: str, rows: list[dict[str, float]]) -> dict[str, Any]:
    return {"algorithm": name, **{k: statistics.fmean(r[k] for r in rows) for k in rows[0]}}


def smallest(rows: list[dict[str, Any]], key: str, target: float) -> dict[str, Any] | None:
    ok = [r for r in rows if r["recall"] >= target]
    return min(ok, key=lambda r: r[key]) if ok else None


def captured(tokens: int, layers: int, queries: int) -> list[Case]:
    """Decode queries and the keys/values before them, captured from SmolLM2-135M-Instruct reading
    Paul Graham's essays (benchmarks/real_model.py): for ``layers`` layers spread over the model,
    the last ``queries`` positions of a ``tokens``-token window, each attending to what precedes it."""
    from real_model import essays, smollm2  # benchmarks/ is on sys.path when run as a script
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    path = smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(essays(), add_special_tokens=False, return_tensors="pt").input_ids[:, :tokens]
    n_layers = model.config.num_hidden_layers
    chosen = sorted({round(i * (n_layers - 1) / max(1, layers - 1)) for i in range(layers)})
    grabbed: dict[int, tuple[torch.Tensor, ...]] = {}

    def grab(index: int):  # type: ignore[no-untyped-def]
        def hook(module, args, kwargs):  # type: ignore[no-untyped-def]
            h = kwargs["hidden_states"][0]
            cos, sin = kwargs["position_embeddings"]
            d = module.head_dim
            q = module.q_proj(h).view(len(h), -1, d).transpose(0, 1)[None]
            k = module.k_proj(h).view(len(h), -1, d).transpose(0, 1)[None]
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            v = module.v_proj(h).view(len(h), -1, d)
            grabbed[index] = (q[0].transpose(0, 1), k[0].transpose(0, 1), v)  # (N, H, D), (N, Hkv, D), (N, Hkv, D)

        return hook

    handles = [model.model.layers[i].self_attn.register_forward_pre_hook(grab(i), with_kwargs=True) for i in chosen]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    cases = []
    for i in chosen:
        q_all, k_all, v_all = grabbed[i]
        for pos in range(tokens - queries, tokens):
            kv = PagedKV.from_dense(k_all[: pos + 1].contiguous(), v_all[: pos + 1].contiguous(), BLOCK)
            q = q_all[pos].contiguous()
            t0 = time.perf_counter()
            dense = dense_attention(q, kv)
            dense_s = time.perf_counter() - t0
            cases.append(Case(q, kv, attention_mass(q, kv), dense, dense_s))
    return cases


def evaluation(cases: list[Case], d: int) -> dict[str, Any]:
    """Every algorithm at its usual settings, then PSA against fixed top-k at equal recall."""
    results = [
        evaluate("esa(0.3)", cases, lambda: ESA(ESAConfig(sparse_ratio=0.3))),
        evaluate("gsa(0.3)", cases, lambda: GSA(GSAConfig(sparse_ratio=0.3))),
        evaluate("gsa_ondevice(0.3)", cases, lambda: GSAOnDevice(d, GSAOnDeviceConfig(sparse_ratio=0.3))),
        evaluate("kvstar(0.3,fp32)", cases, lambda: KVStar(KVStarConfig(sparse_ratio=0.3, store_dtype="float32"))),
        evaluate("kvstar(0.3)", cases, lambda: KVStar(KVStarConfig(sparse_ratio=0.3))),
        evaluate(
            "kvstar(0.3,dims=0.25)",
            cases,
            lambda: KVStar(KVStarConfig(sparse_ratio=0.3, blk_repre_dim_prune_ratio=0.25)),
        ),
        evaluate("psa(eps=0.95)", cases, lambda: PSA(PSAConfig(eps=0.95))),
    ]
    # PSA vs fixed top-k in the same block order (GSA's bound): one fraction for all vs adaptive.
    fractions = [0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    topk = [evaluate(f"topk({f})", cases, lambda f=f: GSA(GSAConfig(sparse_ratio=f, min_blocks=1))) for f in fractions]
    epsilons = [0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999]
    psa = [evaluate(f"psa(eps={e})", cases, lambda e=e: PSA(PSAConfig(eps=e))) for e in epsilons]
    report: dict[str, Any] = {"cases": len(cases), "algorithms": results, "topk_sweep": topk, "psa_sweep": psa}
    for target, key in ((0.98, "98"), (0.95, "95")):
        t, p = smallest(topk, "kv_fraction", target), smallest(psa, "kv_fraction", target)
        report[f"topk_kv_fraction_{key}"] = t["kv_fraction"] if t else None
        report[f"psa_kv_fraction_{key}"] = p["kv_fraction"] if p else None
        report[f"psa_vs_topk_kv_ratio_{key}"] = p["kv_fraction"] / t["kv_fraction"] if t and p else None
    return report


def show(title: str, report: dict[str, Any]) -> None:
    print(f"\n{title}\n{'algorithm':<22}{'KV frac':>9}{'recall':>9}{'rel err':>9}{'time/dense':>12}")
    for r in report["algorithms"] + report["topk_sweep"] + report["psa_sweep"]:
        print(
            f"{r['algorithm']:<22}{r['kv_fraction']:>9.3f}{r['recall']:>9.3f}{r['rel_error']:>9.4f}"
            f"{r['time_vs_dense']:>12.2f}"
        )
    for key in ("98", "95"):
        t, p = report[f"topk_kv_fraction_{key}"], report[f"psa_kv_fraction_{key}"]
        print(
            f"recall >= {key}%: top-k KV {t}, PSA KV {p}, psa_vs_topk_kv_ratio_{key} = "
            f"{report[f'psa_vs_topk_kv_ratio_{key}']}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-real", action="store_true", help="skip the real model (it needs `make bench-deps`)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # latency comparisons on one core
    layers, queries = (2, 6) if args.quick else (4, 16)
    hkv, g, d, tokens = 2, 4, 64, 8192
    cases = generate(layers, queries, tokens, hkv, g, d, seed=0)

    need = [n for c in cases for n in blocks_for_mass(c.q, c.kv, 0.95)]
    dist = {
        "<50": sum(n < 50 for n in need) / len(need),
        "50-100": sum(50 <= n <= 100 for n in need) / len(need),
        ">100": sum(n > 100 for n in need) / len(need),
    }
    print(
        f"blocks needed for 95% mass over {len(need)} (head, query) pairs: "
        + ", ".join(f"{k}: {v:.0%}" for k, v in dist.items())
        + f" (of {tokens // BLOCK} blocks)"
    )
    report: dict[str, Any] = {"blocks_for_95_mass": dist, "tokens": tokens, "block_size": BLOCK}
    report |= evaluation(cases, d)
    show("synthetic", report)
    if not args.no_real:
        real_tokens, real_layers, real_queries = (4096, 4, 3) if args.quick else (7168, 8, 6)
        torch.set_num_threads(2)  # the capture is a forward pass; timings below are again on one core
        real = captured(real_tokens, real_layers, real_queries)
        torch.set_num_threads(1)
        report["real"] = {"model": "SmolLM2-135M-Instruct", "text": "Paul Graham essays", "tokens": real_tokens}
        report["real"] |= evaluation(real, real[0].kv.keys.shape[-1])
        show(f"SmolLM2-135M on essays, {real_tokens} tokens", report["real"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
