"""The common core of the sparse attention algorithms.

Shapes, per request and layer (the way vLLM's paged cache holds them):

- ``q``: ``(H, D)``, one decode query, ``H`` query heads;
- ``keys``/``values``: ``(P, B, Hkv, D)``, the paged cache (``P`` physical blocks of ``B`` tokens);
- ``block_table``: ``(n,)`` physical block of each logical block of the request;
- ``num_tokens``: tokens in the request (the last block may be partly filled).

Query heads are grouped over KV heads (GQA: ``H = G * Hkv``). A selection is, per KV head, the
logical blocks to attend: ``(Hkv, k)``; heads that need fewer blocks pad with ``-1``.
Per-block metadata (:class:`BlockMeta`) is kept incrementally: a block's statistics are computed
once, when it fills (and the partial last block is refreshed as tokens arrive).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    keys: torch.Tensor | BlockReader  # (P, B, Hkv, D)
    values: torch.Tensor | BlockReader  # (P, B, Hkv, D)
    block_table: torch.Tensor  # (n,) long
    num_tokens: int

    @property
    def block_size(self) -> int:
        return int(self.keys.shape[1])

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    def block_keys(self, logical: int) -> torch.Tensor:
        """Keys of one logical block, only its filled tokens: (t, Hkv, D)."""
        b = self.block_size
        filled = min(b, self.num_tokens - logical * b)
        return self.keys[self.block_table[logical], :filled]

    @classmethod
    def from_dense(cls, keys: torch.Tensor, values: torch.Tensor, block_size: int) -> PagedKV:
        """Lay ``(N, Hkv, D)`` keys/values out in blocks (identity block table, padded tail)."""
        n, hkv, d = keys.shape
        blocks = -(-n // block_size)
        pad = blocks * block_size - n
        shape = (blocks, block_size, hkv, d)
        k = torch.cat([keys, keys.new_zeros(pad, hkv, d)]).view(shape)
        v = torch.cat([values, values.new_zeros(pad, hkv, d)]).view(shape)
        return cls(k, v, torch.arange(blocks, device=keys.device), n)


class BlockReader:
    """Blocks of a paged cache stored in another layout, read as ``(P, B, Hkv, D)``.

    ``storage`` is ``(P, Hkv, B*D)``: each block's tokens for one head in some order, which
    ``positions`` undoes (``positions[t*D + d]`` is where token ``t``, channel ``d`` lies). Indexing
    reads only the blocks asked for, in logical layout, so the selectors (which index the first
    dimension with block ids, then slice the rest) work on it as on a tensor."""

    def __init__(self, storage: torch.Tensor, positions: torch.Tensor, block_size: int, head_dim: int) -> None:
        self.storage, self.positions = storage, positions
        self.shape = torch.Size((storage.shape[0], block_size, storage.shape[1], head_dim))
        self.device, self.dtype = storage.device, storage.dtype

    def blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), B, Hkv, D)."""
        _, b, hkv, d = self.shape
        return self.storage[ids][:, :, self.positions].view(len(ids), hkv, b, d).transpose(1, 2)

    def __getitem__(self, key: object) -> torch.Tensor:
        index = key if isinstance(key, tuple) else (key,)
        unique, inverse = torch.unique(torch.as_tensor(index[0], device=self.device), return_inverse=True)
        return self.blocks(unique)[(inverse, *index[1:])]


class BlockMeta:
    """Per-block key statistics, kept current as blocks fill: mean, elementwise min and max, and
    radius (the largest distance of a key from the block's mean)."""

    def __init__(self, hkv: int, d: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.mean = torch.empty(0, hkv, d, device=device, dtype=dtype)
        self.kmin = torch.empty(0, hkv, d, device=device, dtype=dtype)
        self.kmax = torch.empty(0, hkv, d, device=device, dtype=dtype)
        self.radius = torch.empty(0, hkv, device=device, dtype=dtype)
        self.full_blocks = 0  # blocks whose statistics are final
        self.updates = 0  # blocks (re)computed: the cost of keeping metadata

    @classmethod
    def of(cls, kv: PagedKV) -> BlockMeta:
        meta = cls(kv.keys.shape[2], kv.keys.shape[3], kv.keys.device, kv.keys.dtype)
        meta.update(kv)
        return meta

    def update(self, kv: PagedKV) -> None:
        """Compute statistics of blocks that filled since the last call, and of the partial tail."""
        n = kv.num_blocks
        full = kv.num_tokens // kv.block_size
        first = self.full_blocks
        parts = []
        if full > first:  # the newly full blocks, in one batch
            parts.append(self._stats(kv.keys[kv.block_table[first:full]].to(self.dtype), dim=1))
        if n > full:  # the partial tail
            parts.append(tuple(t[None] for t in self._stats(kv.block_keys(full).to(self.dtype), dim=0)))
        if parts:
            mean, kmin, kmax, radius = (torch.cat(c) for c in zip(*parts, strict=True))
            self.mean = torch.cat([self.mean[:first], mean])
            self.kmin = torch.cat([self.kmin[:first], kmin])
            self.kmax = torch.cat([self.kmax[:first], kmax])
            self.radius = torch.cat([self.radius[:first], radius])
        self.updates += n - first
        self.full_blocks = full

    @staticmethod
    def _stats(k: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
        """Mean, min, max and radius over the token dimension ``dim`` of keys (..., Hkv, D)."""
        mean = k.mean(dim)
        return mean, k.amin(dim), k.amax(dim), (k - mean.unsqueeze(dim)).norm(dim=-1).amax(dim)


def group_query(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """(H, D) -> (Hkv, G, D): the query heads that share each KV head."""
    h, d = q.shape
    if h % hkv:
        raise ValueError(f"q: {h} query heads cannot be grouped over {hkv} KV heads")
    return q.view(hkv, h // hkv, d)


def block_logits(q: torch.Tensor, kv: PagedKV, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled scores of every token of the selected blocks, and the matching values.

    ``selected``: (Hkv, k) logical blocks per KV head, -1 for none. Returns logits (Hkv, G, k*B)
    with positions beyond ``num_tokens`` (and of -1 entries) set to -inf, and values (Hkv, k*B, D)."""
    hkv, d = kv.keys.shape[2], kv.keys.shape[3]
    b = kv.block_size
    qg = group_query(q, hkv)
    phys = kv.block_table[selected.clamp(min=0)]  # (Hkv, k)
    heads = torch.arange(hkv, device=q.device)[:, None]
    k_sel = kv.keys[phys, :, heads, :].reshape(hkv, -1, d).to(q.dtype)  # (Hkv, k*B, D)
    v_sel = kv.values[phys, :, heads, :].reshape(hkv, -1, d).to(q.dtype)
    logits = torch.einsum("hgd,htd->hgt", qg, k_sel) / math.sqrt(d)
    pos = selected[:, :, None] * b + torch.arange(b, device=q.device)
    invalid = ((pos >= kv.num_tokens) | (selected[:, :, None] < 0)).reshape(hkv, 1, -1)
    return logits.masked_fill(invalid, float("-inf")), v_sel


def sparse_attention(q: torch.Tensor, kv: PagedKV, selected: torch.Tensor) -> torch.Tensor:
    """Exact attention of ``q`` over the selected blocks only: (H, D)."""
    logits, v_sel = block_logits(q, kv, selected)
    out = torch.einsum("hgt,htd->hgd", torch.softmax(logits, dim=-1), v_sel)
    return out.reshape(q.shape)


def all_blocks(kv: PagedKV) -> torch.Tensor:
    hkv = kv.keys.shape[2]
    return torch.arange(kv.num_blocks, device=kv.keys.device).expand(hkv, -1)


def dense_attention(q: torch.Tensor, kv: PagedKV) -> torch.Tensor:
    """The reference: attention over every token."""
    return sparse_attention(q, kv, all_blocks(kv))


class BlockSelector:
    """The common interface: pick blocks for a query, then attend exactly over them.

    Algorithms that choose blocks up front implement ``select``; one that decides as it goes
    (PSA) overrides ``attend``. ``step`` is the decode step (algorithms may reuse a selection
    between retrievals); ``meta`` is kept current by the algorithms themselves. ``shared``: one
    selection for all KV heads (every row of ``select``'s result is the same), as serving needs.
    """

    shared: bool = False

    def select(self, q: torch.Tensor, kv: PagedKV, meta: BlockMeta, step: int = 0) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} attends progressively; call attend()")

    #: The blocks the last ``attend`` used, per KV head (for evaluation and debugging).
    last_blocks: list[torch.Tensor]

    def attend(self, q: torch.Tensor, kv: PagedKV, meta: BlockMeta, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Output (H, D) and the number of blocks each KV head attended (Hkv,)."""
        selected = self.select(q, kv, meta, step)
        self.last_blocks = [row[row >= 0] for row in selected]
        return sparse_attention(q, kv, selected), (selected >= 0).sum(1)


def topk_with_windows(scores: torch.Tensor, k: int, init_blocks: int, local_blocks: int) -> torch.Tensor:
    """Per KV head, the ``k`` best blocks by ``scores`` (Hkv, n), always including the first
    ``init_blocks`` (attention sinks) and the last ``local_blocks`` (recent context). Sorted."""
    n = scores.shape[1]
    k = max(0, min(k, n))
    forced = torch.zeros(n, dtype=torch.bool, device=scores.device)
    forced[: min(init_blocks, n)] = True
    if local_blocks:
        forced[max(0, n - local_blocks) :] = True
    boosted = scores.masked_fill(forced, float("inf"))
    k = max(k, int(forced.sum()))
    return torch.topk(boosted, k, dim=-1).indices.sort(dim=-1).values


def pad_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-head block lists of different lengths -> (Hkv, k), padded with -1."""
    width = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r.new_full((width - len(r),), -1)]) for r in rows])


def attention_mass(q: torch.Tensor, kv: PagedKV) -> torch.Tensor:
    """Softmax mass of each block, per KV head (summed over its query heads, normalized): (Hkv, n).

    For evaluation only (recall of a selection); selectors never see it."""
    logits, _ = block_logits(q, kv, all_blocks(kv))
    p = torch.softmax(logits, dim=-1)  # (Hkv, G, n*B)
    hkv, g, _ = p.shape
    per_block = p.view(hkv, g, kv.num_blocks, kv.block_size).sum(-1).mean(1)
    return per_block
