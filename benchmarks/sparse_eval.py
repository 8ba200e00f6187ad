"""Sparse attention quality and cost on long contexts: KV attended vs error and mass recall.

Every algorithm is run through the code that serves it: its options (``ucm.sparse.options``) give
the scoring, budget and windows, and :class:`ucm.sparse.summaries.BlockSummaries` keeps the block
summaries (written key by key, as the attention backend writes them) and selects per KV head with
the native kernel, exactly as in an engine step. Only what happens after selection differs: here
the kept blocks are attended in PyTorch, per head, and compared with dense attention.

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

The true attention mass is used only to score. Per algorithm: fraction of KV blocks attended,
output relative error, attention-mass recall (per KV head: the mass of its kept blocks, averaged
over the query heads sharing it), and the selection's CPU time next to dense attention of the same
query. PSA vs fixed top-k ranked by GSA's bound in bfloat16 (one fraction for everything; PSA ranks
by the mean beside the bound): the KV fraction at which each sweep's mean recall reaches 98% (and
95%; linear between sweep points), and their ratio; beside it three bounds that know the true mass
(see ``psa_vs_topk``): per KV head the fewest blocks reaching the target, the same in PSA's own
order (what any stopping rule on PSA's estimate needs for every head to reach it), and one mass
threshold for every head (what any selection needs for that mean recall). On the real case the
comparison is repeated per captured layer and over the layers served sparsely (UCM keeps the first
``dense_layers`` dense): one top-k fraction for every layer lets PSA win by adapting across layers
alone, which a per-layer budget would match.

    python benchmarks/sparse_eval.py --quick --json OUT.json
    python benchmarks/sparse_eval.py --quick --tiny-model --json OUT.json   # the smoke: no bench-deps
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from real_model import add_tiny_flag, model_and_text, model_label  # benchmarks/ is on sys.path when run as a script

from ucm.sparse.config import SparseConfig
from ucm.sparse.options import (
    ESAConfig,
    GSAConfig,
    GSAOnDeviceConfig,
    KVStarConfig,
    PSAConfig,
    StaticConfig,
    TopKConfig,
)
from ucm.sparse.summaries import BlockSummaries

BLOCK = 32
CACHE_DTYPE = torch.bfloat16  # what served engines keep keys in on CPUs with bfloat16 arithmetic (AMX)
# The generator, fixed: recency length scales (tokens), and per band (share of (head, query)
# pairs, the scales its queries weight).
SCALES = (256, 512, 1024, 2048, 4096, 8192)
BANDS = ((0.2, (256, 512)), (0.6, (2048, 4096)), (0.2, (8192,)))
SHARPNESS = 12.0  # query norm: how peaked attention is over the structure
RECENCY = 4.0  # amplitude of the recency features in keys


@dataclass
class Case:
    q: torch.Tensor  # (H, D)
    keys: torch.Tensor  # (N, Hkv, D)
    values: torch.Tensor  # (N, Hkv, D)
    mass: torch.Tensor  # (Hkv, n) true attention mass per block, mean over the group (evaluation only)
    dense: torch.Tensor  # (H, D)
    dense_s: float
    layer: int = -1  # the model layer it was captured from (real case)
    # Computed once per case: the per-layer and served-layer comparisons aggregate the same cases
    # again. A configuration's figures by its name; PSA's estimated shares per (KV head, block).
    figures: dict[str, dict[str, float]] = field(default_factory=dict, repr=False)
    psa_scores: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_blocks(self) -> int:
        return -(-len(self.keys) // BLOCK)


def make_case(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: int = -1) -> Case:
    """The case of one query over ``keys``/``values``, with dense attention timed and the truth."""
    keys = keys.to(CACHE_DTYPE).float()  # what attention reads from a bf16 cache
    values = values.to(CACHE_DTYPE).float()
    t0 = time.perf_counter()
    dense = attend(q, keys, values, None)
    dense_s = time.perf_counter() - t0
    hkv, g = keys.shape[1], q.shape[0] // keys.shape[1]
    n = -(-len(keys) // BLOCK)
    p = probabilities(q, keys)  # (H, N)
    per_block = torch.nn.functional.pad(p, (0, n * BLOCK - len(keys))).view(len(q), n, BLOCK).sum(-1)
    return Case(q, keys, values, per_block.view(hkv, g, n).mean(1), dense, dense_s, layer)


def probabilities(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    g = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(g, 1)  # (N, H, D)
    return torch.softmax(torch.einsum("hd,nhd->hn", q, k) / math.sqrt(q.shape[1]), -1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: list[torch.Tensor] | None) -> torch.Tensor:
    """Attention of each query head over the tokens of its KV head's kept blocks (all: None)."""
    hkv, g = keys.shape[1], q.shape[0] // keys.shape[1]
    out = torch.empty_like(q)
    for h in range(hkv):
        if kept is None:
            k, v = keys[:, h], values[:, h]
        else:
            tokens = (kept[h][:, None] * BLOCK + torch.arange(BLOCK)).flatten()
            tokens = tokens[tokens < len(keys)]
            k, v = keys[tokens, h], values[tokens, h]
        w = torch.softmax(q[h * g : (h + 1) * g] @ k.T / math.sqrt(q.shape[1]), -1)
        out[h * g : (h + 1) * g] = w @ v
    return out


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
        for _ in range(queries):
            q = torch.empty(h, d)
            for head in range(h):
                kvh = head // g
                band = _band(gen)
                mix = torch.tensor([1.0 if s in band else 0.0 for s in SCALES])
                direction = 0.3 * sink[kvh] + 0.25 * retrieval[kvh] + (mix[:, None] * recency[kvh]).sum(0)
                direction += 0.05 * torch.randn(d, generator=gen)
                q[head] = _unit(direction) * SHARPNESS
            cases.append(make_case(q, keys, values))
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


def blocks_for_mass(case: Case, target: float) -> list[int]:
    """Per query head, the fewest blocks holding ``target`` of its attention mass."""
    p = probabilities(case.q, case.keys)
    n = case.num_blocks
    per_block = torch.nn.functional.pad(p, (0, n * BLOCK - len(case.keys))).view(len(p), n, BLOCK).sum(-1)
    cum = per_block.sort(-1, descending=True).values.cumsum(-1)
    return ((cum < target).sum(-1) + 1).tolist()


def select(
    options: TopKConfig | PSAConfig, case: Case, scores: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], float]:
    """The blocks each KV head keeps, through the serving selection; and the seconds it took.
    ``scores`` ((Hkv, blocks) float32) receives each block's estimated share, as the kernel ranks them."""
    n, (hkv, d) = case.num_blocks, case.keys.shape[1:]
    budget = int(options.budget_blocks(torch.tensor([n]), BLOCK)[0])
    sink, local = options.windows(BLOCK)
    scoring = options.scoring(d)
    if scoring is None:  # static: the windows and the most recent blocks, nothing scored
        recent = torch.arange(n - (budget - min(sink, budget)), n)
        blocks = torch.unique(torch.cat([torch.arange(min(sink, budget)), recent]))
        return [blocks] * hkv, 0.0
    summaries = BlockSummaries(scoring, n, BLOCK, hkv, d, CACHE_DTYPE)
    summaries.write(case.keys.to(CACHE_DTYPE), torch.arange(len(case.keys)))
    out = torch.empty(hkv, budget, dtype=torch.int32)
    kept = torch.empty(hkv, dtype=torch.int32)
    one = torch.tensor([0], dtype=torch.int32)
    t0 = time.perf_counter()
    summaries.select(
        case.q[None],
        one,
        torch.arange(n, dtype=torch.int32)[None],
        torch.tensor([len(case.keys)], dtype=torch.int32),
        torch.tensor([budget], dtype=torch.int32),
        (sink, local),
        1 / math.sqrt(d),
        out,
        mass=scoring.mass,
        kept=kept,
        scores=scores,
    )
    secs = time.perf_counter() - t0
    counts = kept.tolist() if scoring.mass > 0 else [budget] * hkv
    return [out[h, : counts[h]].long() // hkv for h in range(hkv)], secs


def evaluate(name: str, cases: list[Case], options: TopKConfig | PSAConfig) -> dict[str, Any]:
    """Mean KV fraction, relative error, mass recall and time vs dense of one configuration."""
    rows = [case_figures(name, case, options) for case in cases]
    return {"algorithm": name, **{k: statistics.fmean(r[k] for r in rows) for k in rows[0]}}


def case_figures(name: str, case: Case, options: TopKConfig | PSAConfig) -> dict[str, float]:
    """One case's figures under the configuration called ``name`` (computed on first use)."""
    if name not in case.figures:
        kept, secs = select(options, case)
        out = attend(case.q, case.keys, case.values, kept)
        case.figures[name] = {
            "kv_fraction": statistics.fmean(len(b) for b in kept) / case.num_blocks,
            "rel_error": float((out - case.dense).norm() / case.dense.norm()),
            "recall": statistics.fmean(float(case.mass[h][b].sum()) for h, b in enumerate(kept)),
            "time_vs_dense": secs / case.dense_s,
        }
    return case.figures[name]


def kv_at_recall(rows: list[dict[str, Any]], target: float) -> float | None:
    """The KV fraction at which a sweep's mean recall reaches ``target``: linear between the two
    sweep points around it (the grid's step alone would overstate it by up to a step)."""
    below = None
    for row in sorted(rows, key=lambda r: r["kv_fraction"]):
        if row["recall"] >= target:
            if below is None or below["recall"] >= row["recall"]:
                return row["kv_fraction"]
            w = (target - below["recall"]) / (row["recall"] - below["recall"])
            return below["kv_fraction"] + w * (row["kv_fraction"] - below["kv_fraction"])
        below = row
    return None


def captured(tokens: int, layers: int, queries: int, tiny: bool = False) -> list[Case]:
    """Decode queries and the keys/values before them, captured from SmolLM2-135M-Instruct reading
    Paul Graham's essays (benchmarks/real_model.py): for ``layers`` layers spread over the model,
    the last ``queries`` positions of a ``tokens``-token window, each attending to what precedes it.
    ``tiny``: the demo model reading its corpus instead (real_model.model_and_text): the same flow,
    figures that mean nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    path, text = model_and_text(tiny)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise SystemExit(f"sparse_eval: the text is {ids.shape[1]} tokens, fewer than {tokens}")
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
            cases.append(make_case(q_all[pos].contiguous(), k_all[: pos + 1], v_all[: pos + 1], i))
    return cases


ALGORITHMS: dict[str, TopKConfig | PSAConfig] = {
    "esa(0.3)": ESAConfig(sparse_ratio=0.3),
    "gsa(0.3)": GSAConfig(sparse_ratio=0.3),
    "gsa(0.3,both)": GSAConfig(sparse_ratio=0.3, block_repre="both"),
    "gsa(0.3,bfloat16)": GSAConfig(sparse_ratio=0.3, summary_dtype="bfloat16"),
    "gsa_ondevice(0.3)": GSAOnDeviceConfig(sparse_ratio=0.3),
    "kvstar(0.3)": KVStarConfig(sparse_ratio=0.3),
    "kvstar(0.3,dims=0.25)": KVStarConfig(sparse_ratio=0.3, blk_repre_dim_prune_ratio=0.25),
    "static(0.3)": StaticConfig(sparse_ratio=0.3),
    "psa(eps=0.95)": PSAConfig(eps=0.95),
}


def evaluation(cases: list[Case]) -> dict[str, Any]:
    """Every algorithm at its usual settings, then PSA against fixed top-k at equal recall."""
    results = [evaluate(name, cases, options) for name, options in ALGORITHMS.items()]
    return {"cases": len(cases), "algorithms": results} | psa_vs_topk(cases)


TOPK_FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
PSA_EPSILONS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.993, 0.995, 0.997, 0.999)


def psa_vs_topk(cases: list[Case]) -> dict[str, Any]:
    """PSA vs fixed top-k ranked by GSA's bfloat16 bound at equal mean recall: one fraction for all
    vs adaptive. Beside them three bounds that know the true mass: the per-head oracle keeps, per
    KV head, the fewest blocks reaching the target (every head at the target); the ranked oracle
    does so in PSA's own order (the best a stopping rule on PSA's estimate can do, every head at
    the target); the threshold oracle keeps every block above one mass threshold, the same for
    every head (the least KV any selection needs for that mean recall, within a block)."""
    topk = [
        evaluate(f"topk({f})", cases, GSAConfig(sparse_ratio=f, min_blocks=1, summary_dtype="bfloat16"))
        for f in TOPK_FRACTIONS
    ]
    psa = [evaluate(f"psa(eps={e})", cases, PSAConfig(eps=e)) for e in PSA_EPSILONS]
    report: dict[str, Any] = {"topk_sweep": topk, "psa_sweep": psa}
    for target, key in ((0.98, "98"), (0.95, "95")):
        t, p = kv_at_recall(topk, target), kv_at_recall(psa, target)
        report[f"topk_kv_fraction_{key}"] = t
        report[f"psa_kv_fraction_{key}"] = p
        report[f"psa_vs_topk_kv_ratio_{key}"] = p / t if t and p else None
        bounds = {
            "oracle": statistics.fmean(n / c.num_blocks for c in cases for n in oracle_blocks(c, target)),
            "ranked_oracle": statistics.fmean(n / c.num_blocks for c in cases for n in ranked_oracle_blocks(c, target)),
            "threshold_oracle": threshold_oracle_fraction(cases, target),
        }
        for bound, fraction in bounds.items():
            report[f"{bound}_kv_fraction_{key}"] = fraction
            report[f"{bound}_vs_topk_kv_ratio_{key}"] = fraction / t if t else None
    return report


def oracle_blocks(case: Case, target: float) -> list[int]:
    """Per KV head, the fewest blocks whose true mass (the group's mean) reaches ``target``."""
    cum = case.mass.sort(-1, descending=True).values.cumsum(-1)
    return ((cum < target).sum(-1) + 1).tolist()


def threshold_oracle_fraction(cases: list[Case], target: float) -> float:
    """Mean KV fraction when every (case, KV head) keeps its blocks of true mass above one threshold,
    the lowest reaching a mean recall of ``target``: blocks taken by mass per unit of KV fraction
    (a fractional knapsack, so no selection reaches that mean recall with less, but for a block)."""
    mass = torch.cat([c.mass.flatten() for c in cases]).double()
    cost = torch.cat([torch.full((c.mass.numel(),), 1.0 / c.num_blocks) for c in cases]).double()
    heads = sum(c.mass.shape[0] for c in cases)
    order = torch.argsort(mass / cost, descending=True)
    short = torch.cumsum(mass[order], 0) < target * heads
    taken = int(short.sum()) + 1
    return float(cost[order][:taken].sum()) / heads


def ranked_oracle_blocks(case: Case, target: float) -> list[int]:
    """Per KV head, the fewest blocks reaching ``target`` of the true mass when taken in PSA's order:
    its windows first, then by its estimated share (ties in block order, as the kernel ranks)."""
    options = PSAConfig()
    sink, local = options.windows(BLOCK)
    n = case.num_blocks
    if case.psa_scores is None:
        scores = torch.empty(case.keys.shape[1], n, dtype=torch.float32)
        select(options, case, scores)
        scores[:, : min(sink, n)] = math.inf
        scores[:, max(0, n - local) :] = math.inf
        case.psa_scores = scores
    order = torch.sort(case.psa_scores, dim=-1, descending=True, stable=True).indices
    cum = case.mass.gather(-1, order).cumsum(-1)
    return ((cum < target).sum(-1) + 1).clamp(min=min(n, sink + local), max=n).tolist()


def layer_figures(cases: list[Case]) -> dict[str, Any]:
    """PSA vs top-k per captured layer and over the layers served sparsely (UCM's default keeps the
    first ``dense_layers`` dense): one fraction for every layer lets PSA win by adapting across
    layers alone, so the figures within a layer show what adapting per head buys."""
    dense = SparseConfig.model_fields["dense_layers"].default
    served = [c for c in cases if c.layer >= dense]

    def figures_of(subset: list[Case]) -> dict[str, Any]:
        return {k: v for k, v in psa_vs_topk(subset).items() if not k.endswith("_sweep")} | {"cases": len(subset)}

    layers = sorted({c.layer for c in cases})
    return {  # no layer served sparsely: a model of dense_layers layers or fewer (the tiny one)
        "sparse_layers": {"layers": sorted({c.layer for c in served})}
        | (figures_of(served) if served else {"cases": 0}),
        "by_layer": {str(layer): figures_of([c for c in cases if c.layer == layer]) for layer in layers},
    }


def show(title: str, report: dict[str, Any]) -> None:
    print(f"\n{title}\n{'algorithm':<22}{'KV frac':>9}{'recall':>9}{'rel err':>9}{'time/dense':>12}")
    for r in report["algorithms"] + report["topk_sweep"] + report["psa_sweep"]:
        print(
            f"{r['algorithm']:<22}{r['kv_fraction']:>9.3f}{r['recall']:>9.3f}{r['rel_error']:>9.4f}"
            f"{r['time_vs_dense']:>12.2f}"
        )
    for key in ("98", "95"):
        print(f"recall >= {key}%: " + psa_line(report, key))


def psa_line(figures: dict[str, Any], key: str) -> str:
    def f(name: str) -> str:
        value = figures[name]
        return "-" if value is None else f"{value:.3f}"

    return (
        f"top-k KV {f(f'topk_kv_fraction_{key}')}, PSA KV {f(f'psa_kv_fraction_{key}')}, "
        f"psa_vs_topk_kv_ratio_{key} {f(f'psa_vs_topk_kv_ratio_{key}')} (bounds, KV and ratio: per-head oracle "
        f"{f(f'oracle_kv_fraction_{key}')} {f(f'oracle_vs_topk_kv_ratio_{key}')}; PSA's order stopped exactly "
        f"{f(f'ranked_oracle_kv_fraction_{key}')} {f(f'ranked_oracle_vs_topk_kv_ratio_{key}')}; one threshold "
        f"{f(f'threshold_oracle_kv_fraction_{key}')} {f(f'threshold_oracle_vs_topk_kv_ratio_{key}')})"
    )


def show_layers(figures: dict[str, Any]) -> None:
    served = figures["sparse_layers"]
    print(f"\nPSA vs top-k at >= 98% recall, per layer (the layers served sparsely: {served['layers']})")
    for layer, per_layer in figures["by_layer"].items():
        print(f"layer {layer:>3} ({per_layer['cases']} queries): " + psa_line(per_layer, "98"))
    if served["cases"]:
        print(f"sparse layers ({served['cases']} queries): " + psa_line(served, "98"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-real", action="store_true", help="skip the real model (it needs `make bench-deps`)")
    add_tiny_flag(parser)  # the real case on the demo model: 1,024 tokens, its 2 layers, 3 queries each
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # latency comparisons on one core
    layers, queries = (2, 6) if args.quick else (4, 16)
    hkv, g, d, tokens = 2, 4, 64, 8192
    cases = generate(layers, queries, tokens, hkv, g, d, seed=0)

    need = [n for c in cases for n in blocks_for_mass(c, 0.95)]
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
    report |= evaluation(cases)
    show("synthetic", report)
    if not args.no_real:
        real_tokens, real_layers, real_queries = (
            (1024, 2, 3) if args.tiny_model else (4096, 4, 3) if args.quick else (7168, 8, 6)
        )
        torch.set_num_threads(2)  # the capture is a forward pass; timings below are again on one core
        real = captured(real_tokens, real_layers, real_queries, tiny=args.tiny_model)
        torch.set_num_threads(1)
        model, text = model_label(args.tiny_model), "the demo corpus" if args.tiny_model else "Paul Graham essays"
        report["real"] = {"model": model, "text": text, "tokens": real_tokens}
        report["real"] |= evaluation(real) | layer_figures(real)
        show(f"{model} on {text}, {real_tokens} tokens", report["real"])
        show_layers(report["real"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
