"""Block summaries kept at KV-write time, and block selection over them, for one layer.

Summaries live in tensors allocated once per layer and indexed by physical block id, like the paged
cache itself. When the attention backend writes a token's key into the cache it folds the key into
its block's summary (:meth:`BlockSummaries.write`); a token at offset 0 starts its block afresh, so
a block handed to another request needs no clean-up. Blocks whose bytes arrive another way (the
connector loading them from a store) are invalidated and recomputed from the cache before they are
scored (:meth:`invalidate`, :meth:`stale`, :meth:`refresh`). ``count[p]`` is the number of tokens
block ``p``'s summary holds.

Three kinds of summary, one per way of scoring a block for a query:

- ``bound`` (Quest): per channel, the smallest and largest key in the block; a block's score for
  query ``q`` is ``sum_d max(q_d * lo_d, q_d * hi_d)``, an upper bound of every ``q . k`` in it. Kept
  in the cache's dtype (min and max of stored values are exact).
  Scored as ``q . c + |q| . r`` (centre, radius) from bfloat16, or from bytes (``QUANTIZED``): one
  scale per block head, the centre rounded to nearest and its error added to the radius, rounded
  up, so that the bound stays a bound; half the bytes, and integer dot products against the query
  quantized per head.
- ``mean``: the mean key (ESA's block representation, KVStar's); score ``q . mean``, optionally over
  the channels where the query group's magnitude is largest (KVStar's pruned representation).
- ``hash`` (GSA on-device): sign bits of each token's key under a fixed random rotation; a block's
  score is minus the smallest Hamming distance between the query's bits and its tokens' bits.
- ``both``: the mean and the bound, each turned into a softmax over blocks per query head and the
  two averaged: the bound alone overrates blocks whose keys spread widely, the mean alone dilutes a
  single matching key. On SmolLM2's activations (benchmarks/sparse_eval.py) it keeps about the mass
  the bound keeps (0.904 vs 0.912 at 30% of the KV) and more than the mean (0.876), and it makes
  PSA's adaptive estimate less overconfident; on needles it did no better than the bound, and it
  reads half as many bytes again per block, which is what selection costs at long context: GSA
  scores by the bound alone unless told otherwise.

Selection (:meth:`select`) is one native call per layer for the whole step: per (request, KV head)
it scores every block, turns each query head's scores into a softmax over blocks (so that no head
outvotes the others), sums them over the heads sharing the KV head, keeps the sink and local windows
and the best of the rest up to the request's budget, and writes the kept blocks, ascending, as rows
of the cache viewed as ``(blocks * kv_heads, 1, block_size, head_dim)``: ``phys * kv_heads + head``.
vLLM's paged attention kernel then attends per-head block tables in one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

try:
    import ucm_native as _native
except ImportError:  # checked where sparse attention is configured
    _native = None

Mode = Literal["bound", "mean", "hash", "both"]
MODES: dict[str, int] = {"bound": 0, "mean": 1, "hash": 2, "both": 3}
DTYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
QUANTIZED = torch.uint8  # representations as bytes with a scale per block head (bound only)
REP_DTYPES: dict[torch.dtype, int] = {**DTYPES, QUANTIZED: 3}
REP_ROWS: dict[str, int] = {"mean": 1, "bound": 2, "both": 3}  # a block head's representation: [mean] [c | r]


def native_available() -> bool:
    return _native is not None and hasattr(_native, "SparseSummaries")


@dataclass(frozen=True)
class Scoring:
    """How an algorithm summarizes and scores blocks."""

    mode: Mode
    dtype: torch.dtype | None = None  # of the representations scored; None: bfloat16 (ranking needs no more);
    # QUANTIZED (bound only): bytes and a scale per block head, scored in integers (ucm_native's sparse.h)
    keep_channels: float = 1.0  # mean: share of channels scored (those the query weights most)
    hash_bits: int = 0  # hash: sign bits per key
    seed: int = 0  # hash: the rotation's seed
    mass: float = 0.0  # > 0: an adaptive budget, the blocks holding this share of the estimate (PSA)

    def temperature(self, head_dim: int, scale: float) -> float:
        """Logit per unit of score: the attention scale for dot products; for Hamming distance, one
        bit of a ``bits``-bit hash turns a key by ``pi / bits``, worth about ``head_dim * scale *
        pi / bits`` of logit for keys and queries of norm ``sqrt(head_dim)``."""
        if self.mode == "hash":
            return head_dim * scale * torch.pi / self.hash_bits
        return scale


def haar_orthogonal(d: int, seed: int) -> torch.Tensor:
    """A random rotation of R^d (QR of a seeded Gaussian, sign-corrected to be Haar-distributed).
    Computed in float64 from an integer seed: the same bits on every CPU."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32)


class BlockSummaries:
    """One layer's summaries of ``num_blocks`` physical blocks, kept by :meth:`write`."""

    def __init__(
        self,
        scoring: Scoring,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        cache_dtype: torch.dtype,
    ) -> None:
        if not native_available():
            raise RuntimeError("sparse attention needs the native module ucm_native (make dev builds it)")
        self.scoring = scoring
        self.num_blocks, self.block_size, self.kv_heads, self.head_dim = num_blocks, block_size, kv_heads, head_dim
        self.dtype = scoring.dtype or torch.bfloat16  # of the representations scored
        if cache_dtype not in DTYPES:
            raise ValueError(f"summaries: cache dtype {cache_dtype} is not one of float32, bfloat16, float16")
        if self.dtype not in REP_DTYPES:
            raise ValueError(f"summaries: dtype {self.dtype} is not one of float32, bfloat16, float16, uint8")
        if self.dtype == QUANTIZED and scoring.mode != "bound":
            raise ValueError(f"summaries: quantized (uint8) representations score the bound only, not {scoring.mode!r}")
        shape = (num_blocks, kv_heads, head_dim)
        empty = torch.empty(0)
        self.lo = self.hi = self.mean = self.rep = self.rep_scale = self.hashes = self.projection = empty
        if scoring.mode in ("bound", "both"):
            self.lo, self.hi = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
        if scoring.mode in ("mean", "both"):
            self.mean = torch.zeros(shape, dtype=torch.float32)
        if scoring.mode != "hash":  # what selection reads
            self.rep = torch.zeros(num_blocks, kv_heads, REP_ROWS[scoring.mode], head_dim, dtype=self.dtype)
            if self.dtype == QUANTIZED:
                self.rep_scale = torch.zeros(num_blocks, kv_heads, dtype=torch.float32)
        else:
            bits = scoring.hash_bits
            if bits % 8 or not 8 <= bits <= head_dim:
                raise ValueError(f"hash_bits: a multiple of 8 in [8, head_dim={head_dim}], got {bits}")
            self.projection = haar_orthogonal(head_dim, scoring.seed)[:, :bits].contiguous()
            self.hashes = torch.zeros(num_blocks, block_size, kv_heads, bits // 8, dtype=torch.uint8)
        self.count = torch.zeros(num_blocks, dtype=torch.int32)
        self._kernel = _native.SparseSummaries(
            mode=MODES[scoring.mode],
            dtype=DTYPES[cache_dtype],
            rep_dtype=REP_DTYPES[self.dtype],
            lo=_ptr(self.lo),
            hi=_ptr(self.hi),
            mean=_ptr(self.mean),
            rep=_ptr(self.rep),
            rep_scale=_ptr(self.rep_scale),
            hashes=_ptr(self.hashes),
            projection=_ptr(self.projection),
            count=self.count.data_ptr(),
            block_size=block_size,
            kv_heads=kv_heads,
            head_dim=head_dim,
            hash_bytes=scoring.hash_bits // 8,
        )

    def write(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Fold ``keys`` (T, Hkv, D), written at cache ``slots`` (T,) (-1: padding), into the summaries."""
        if keys.stride(2) != 1 or keys.stride(1) != self.head_dim:
            keys = keys.contiguous()
        slots = slots.to(torch.int64).contiguous()
        self._kernel.write(keys.data_ptr(), DTYPES[keys.dtype], keys.stride(0), slots.data_ptr(), len(slots))

    def invalidate(self, blocks: torch.Tensor) -> None:
        """Blocks whose bytes changed without :meth:`write` (loaded from a store)."""
        self.count[blocks.long()] = 0

    def copy_rows(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Blocks ``source`` summarized again as blocks ``target`` (long): their bytes moved there."""
        for t in (self.lo, self.hi, self.mean, self.rep, self.rep_scale, self.hashes, self.count):
            if t.numel():
                t[target] = t[source]

    def stale(self, tables: torch.Tensor, full_blocks: torch.Tensor, resident: int | None = None) -> torch.Tensor:
        """Distinct physical blocks among the first ``full_blocks[r]`` of each row of ``tables``
        whose summary does not cover the whole block (int32). Ids from ``resident`` on are blocks
        moved out of the cache (:meth:`copy_rows`): full, and not in the cache to refresh from."""
        cols = torch.arange(tables.shape[1])
        blocks = tables[cols[None, :] < full_blocks[:, None]]
        if resident is not None:
            blocks = blocks[blocks < resident]
        return torch.unique(blocks[self.count[blocks.long()] != self.block_size]).to(torch.int32)

    def refresh(self, key_cache: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor) -> None:
        """Recompute full ``blocks`` (int32) from ``key_cache`` ((P, Hkv, ...) as stored), where element
        (t, d) of a block's head lies at offset ``positions[t * D + d]`` of that head's keys."""
        if positions.dtype != torch.int32 or blocks.dtype != torch.int32:
            raise TypeError("refresh: positions and blocks are int32")
        fill = torch.full_like(blocks, self.block_size)
        self._kernel.refresh(
            key_cache.data_ptr(),
            DTYPES[key_cache.dtype],
            key_cache.stride(0),
            key_cache.stride(1),
            positions.data_ptr(),
            blocks.data_ptr(),
            fill.data_ptr(),
            len(blocks),
        )

    def select(
        self,
        query: torch.Tensor,
        tokens: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        budget: torch.Tensor,
        windows: tuple[int, int],
        scale: float,
        out: torch.Tensor,
        mass: float = 0.0,
        kept: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        prior: torch.Tensor | None = None,
    ) -> None:
        """Kept blocks of each (request, KV head) into ``out`` ((R * Hkv, >= max budget) int32).

        ``query``: (tokens, H, D), each head's row contiguous; ``tokens``, ``seq_lens``, ``budget``:
        (R,) int32, the query row, length and blocks to keep of each request; ``tables``: (R, W) int32
        physical blocks. With ``mass`` > 0 a (request, KV head) keeps, best first, the fewest blocks
        whose estimated share of the group's attention reaches ``mass`` (at most its budget), and
        ``kept`` ((R * Hkv,) int32) receives how many. ``scores`` ((R * Hkv, >= blocks) float32), when
        given, receives each block's estimated share (summed over the group's query heads) before
        the windows are forced. ``prior`` ((num_blocks, kv_heads) float32), when given, is added to
        each block's score by physical block and KV head before the best are taken."""
        if query.stride(2) != 1 or query.stride(1) != self.head_dim:
            query = query.contiguous()
        if prior is not None and (
            prior.dtype != torch.float32 or prior.shape != (self.num_blocks, self.kv_heads) or not prior.is_contiguous()
        ):
            raise ValueError(f"select: prior must be float32 ({self.num_blocks}, {self.kv_heads})")
        keep = self.scoring.keep_channels
        self._kernel.select(
            query=query.data_ptr(),
            query_dtype=DTYPES[query.dtype],
            token_stride=query.stride(0),
            heads=query.shape[1],
            tokens=tokens.data_ptr(),
            rows=len(tokens),
            block_table=tables.data_ptr(),
            table_stride=tables.stride(0),
            seq_lens=seq_lens.data_ptr(),
            budget=budget.data_ptr(),
            init=windows[0],
            local=windows[1],
            keep_channels=0 if keep >= 1 else max(1, round(keep * self.head_dim)),
            temperature=self.scoring.temperature(self.head_dim, scale),
            mass=mass,
            out=out.data_ptr(),
            out_stride=out.stride(0),
            kept=0 if kept is None else kept.data_ptr(),
            scores=0 if scores is None else scores.data_ptr(),
            score_stride=0 if scores is None else scores.stride(0),
            prior=0 if prior is None else prior.data_ptr(),
        )


def fetch_into_slots(
    table: torch.Tensor,
    slots: torch.Tensor,
    holds: torch.Tensor,
    slot_of: torch.Tensor,
    arena: torch.Tensor,
    planes: torch.Tensor,
) -> int:
    """Sparse off-load, one layer: the arena planes named in ``table`` ((R * Hkv, W) int32 entries
    from ``len(planes)`` on: ``len(planes) + arena plane``) copied into the cache planes of their
    rows' slots (``slots``: (R, K) int64 cache blocks, -1 past a row's), and the entries rewritten
    to those planes. ``holds`` ((len(planes),) int32) and ``slot_of`` ((len(arena),) int32) say what
    the slots hold from earlier steps: a block held already is not copied again. Returns the planes
    copied. ``arena`` and ``planes``: (n, 2 * block_size, head_dim), contiguous."""
    assert _native is not None
    return _native.sparse_fetch(
        table=table.data_ptr(),
        rows=len(table),
        width=table.shape[1],
        table_stride=table.stride(0),
        kv_heads=len(table) // len(slots),
        resident_planes=len(planes),
        slots=slots.data_ptr(),
        slot_stride=slots.stride(0),
        holds=holds.data_ptr(),
        slot_of=slot_of.data_ptr(),
        arena=arena.data_ptr(),
        planes=planes.data_ptr(),
        plane_bytes=arena[0].numel() * arena.element_size(),
    )


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr() if t.numel() else 0
