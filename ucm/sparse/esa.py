"""ESA: blocks represented by their mean key, scored by dot product with the query.

Per KV head, the score of a block is the sum over that head's query group of ``q . mean(k)``.
The ``init_window_sz`` first blocks (attention sinks) and the ``local_window_sz`` last blocks are
always kept; the rest is filled by top-k up to ``sparse_ratio`` of the blocks (at least
``min_blocks``). Retrieval runs every ``retrieval_stride`` decode steps; in between the selection
is reused, plus any blocks that became local. With ``background=True`` a retrieval worker computes
the next selection off the critical path from the current query, and the one after uses it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ucm.sparse.base import BlockMeta, BlockSelector, PagedKV, group_query, pad_rows
from ucm.sparse.options import ESAConfig


def mean_scores(q: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """(H, D) query, (n, Hkv, D) block means -> (Hkv, n) scores."""
    qg = group_query(q, means.shape[1]).sum(1)  # (Hkv, D): the group's summed query
    return torch.einsum("hd,nhd->hn", qg, means)


class ESA(BlockSelector):
    def __init__(self, config: ESAConfig | None = None, shared: bool = False) -> None:
        self.config = config or ESAConfig()
        self.shared = shared
        self._reuse = Reused()
        self._pending: Future[torch.Tensor] | None = None
        self._worker = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="esa-retrieval") if self.config.background else None
        )
        self.retrievals = 0

    def _retrieve(self, q: torch.Tensor, means: torch.Tensor, block_size: int) -> torch.Tensor:
        self.retrievals += 1
        return self.config.choose(mean_scores(q, means), block_size, self.shared)

    def select(self, q: torch.Tensor, kv: PagedKV, meta: BlockMeta, step: int = 0) -> torch.Tensor:
        c = self.config
        reuse = self._reuse
        due = reuse.selection is None or step % c.retrieval_stride == 0
        if self._worker is not None:
            if self._pending is not None and self._pending.done():
                reuse.set(self._pending.result())
                self._pending = None
            if due and self._pending is None:
                meta.update(kv)
                self._pending = self._worker.submit(self._retrieve, q.clone(), meta.mean.clone(), kv.block_size)
            if reuse.selection is None:
                reuse.set(self._pending.result() if self._pending else self._retrieve(q, meta.mean, kv.block_size))
                self._pending = None
        elif due:
            meta.update(kv)  # metadata is needed only when retrieving
            reuse.set(self._retrieve(q, meta.mean, kv.block_size))
        return reuse.with_recent(kv.num_blocks, c.windows(kv.block_size)[1])

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


class Reused:
    """A selection kept between retrievals; with the blocks that became local since, computed once
    per length (between retrievals a step then costs no tensor work at all)."""

    def __init__(self) -> None:
        self.selection: torch.Tensor | None = None
        self._n = -1
        self._current: torch.Tensor | None = None

    def set(self, selection: torch.Tensor) -> None:
        self.selection, self._n = selection, -1

    def with_recent(self, n: int, local: int) -> torch.Tensor:
        assert self.selection is not None
        if n != self._n or self._current is None:
            self._current, self._n = with_recent(self.selection, n, local), n
        return self._current


def with_recent(selection: torch.Tensor, n: int, local: int) -> torch.Tensor:
    """A reused selection plus the blocks that are local now (new blocks appear as decoding runs)."""
    recent = torch.arange(max(0, n - local), n, device=selection.device)
    hkv = selection.shape[0]
    return pad_rows([torch.unique(torch.cat([row[(row >= 0) & (row < n)], recent])) for row in selection[:hkv]])
