"""Sparse attention in a serving engine: which requests decode sparsely, their selectors per layer,
and the blocks attention then reads. Torch only; ``ucm.integration.vllm.attention`` calls it from
inside vLLM's attention backend.

Each engine step, :meth:`SparseRuntime.begin_step` looks at the batch: a row decodes sparsely when
it computes one token (a decode) and its context has at least ``min_tokens``. Prefill chunks and
short requests stay dense, in the same batch. A running request is recognized from one step to
the next by the physical block it is writing into (a partly filled block belongs to one request
only) and by its length growing by one; anything else starts fresh, and requests that leave the
batch are forgotten. Per layer, :meth:`SparseRuntime.select` runs the algorithm of
:mod:`ucm.sparse` for that request (its block metadata kept incrementally as blocks fill) with one
selection for all KV heads — what a paged kernel with one block table per request can attend —
and returns logical block indices, ascending, always ending with the block being written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ucm import metrics
from ucm.config import ConfigError
from ucm.sparse.base import BlockMeta, BlockSelector, PagedKV
from ucm.sparse.config import SparseConfig
from ucm.sparse.esa import ESA
from ucm.sparse.gsa import GSA
from ucm.sparse.gsa_ondevice import GSAOnDevice
from ucm.sparse.kvstar import KVStar
from ucm.sparse.psa import PSA


@dataclass
class Selection:
    blocks: torch.Tensor  # logical block indices, ascending; the last is the block being written
    physical: torch.Tensor  # the same blocks' ids in the paged cache
    output: torch.Tensor | None = None  # PSA attends as it selects: its output (H, D); blocks is then
    # only the block being written (the kernel's row must end there; its result is replaced)


@dataclass
class LayerState:
    selector: BlockSelector
    meta: BlockMeta
    chose: torch.Tensor | None = None  # what the selector returned last
    last: Selection | None = None  # and what it became
    last_blocks: int = 0  # the request's length in blocks then


@dataclass
class RequestState:
    """One running request: its length, decode steps since it turned sparse, its selectors."""

    seq_len: int
    steps: int = 0
    layers: dict[str, LayerState] = field(default_factory=dict)


@dataclass
class StepStats:
    requests: int = 0  # requests that started decoding sparsely
    attended: float = 0  # blocks attended (PSA: mean over KV heads), summed over requests and layers
    available: int = 0  # blocks those requests hold, summed the same way
    seconds: float = 0.0  # spent selecting
    selections: int = 0


class SparseRuntime:
    def __init__(self, config: SparseConfig, block_size: int, num_kv_heads: int, head_dim: int) -> None:
        self.config = config
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self._requests: dict[int, RequestState] = {}  # by the physical block each request writes into
        # Between retrievals a selection stands as it is until a new block appears (ESA, KVStar).
        self.stride = getattr(config.options, "retrieval_stride", 1)
        self.stats = StepStats()
        self.totals = StepStats()  # since start, for tests and benchmarks
        self._selector()  # fail at startup, not at the first long request (e.g. hash_bits > head_dim)

    def _selector(self) -> BlockSelector:
        c = self.config
        options = c.options
        if c.algorithm == "esa":
            return ESA(options, shared=True)
        if c.algorithm == "gsa":
            return GSA(options, shared=True)
        if c.algorithm == "kvstar":
            return KVStar(options, shared=True)
        if c.algorithm == "psa":
            return PSA(options)
        try:
            return GSAOnDevice(self.head_dim, options, shared=True)
        except ValueError as exc:
            raise ConfigError(f"sparse.gsa_ondevice.{exc}") from None

    def begin_step(
        self, block_table: torch.Tensor, seq_lens: list[int], query_lens: list[int]
    ) -> list[RequestState | None]:
        """The state of each row of the batch that decodes sparsely, None for dense rows."""
        self._flush()
        b, old = self.block_size, self._requests
        self._requests = {}
        rows: list[RequestState | None] = []
        for i, (seq, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
            if q_len != 1 or seq < self.config.min_tokens:
                rows.append(None)
                continue
            n = -(-seq // b)
            writing = int(block_table[i, n - 1])
            state = old.pop(writing, None)
            if state is None and (seq - 1) % b == 0 and n >= 2:  # it just started a new block
                state = old.pop(int(block_table[i, n - 2]), None)
            if state is None or state.seq_len + 1 != seq:
                state = RequestState(seq)
                self.stats.requests += 1
            else:
                state.seq_len, state.steps = seq, state.steps + 1
            self._requests[writing] = state
            rows.append(state)
        return rows

    def select(
        self,
        layer: str,
        state: RequestState,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        block_ids: torch.Tensor,
    ) -> Selection:
        """Blocks one request attends in one layer. ``q``: (H, D); ``keys``/``values``: the layer's
        cache as (P, B, Hkv, D); ``block_ids``: the request's physical blocks, in order."""
        started = time.perf_counter()
        layer_state = state.layers.get(layer)
        if layer_state is None:
            meta = BlockMeta(self.num_kv_heads, self.head_dim, q.device)
            layer_state = state.layers[layer] = LayerState(self._selector(), meta)
        selector = layer_state.selector
        kv = PagedKV(keys, values, block_ids, state.seq_len)
        n = kv.num_blocks
        if layer_state.last is not None and layer_state.last_blocks == n and state.steps % self.stride:
            chosen = layer_state.last  # no retrieval due and no new block: the same blocks
            attended = len(chosen.blocks)
        elif isinstance(selector, PSA):  # its own exact attention, each KV head over its own blocks
            output, used = selector.attend(q.float(), kv, layer_state.meta)
            blocks = torch.tensor([n - 1])
            chosen = Selection(blocks, block_ids[blocks], output)
            attended = float(used.float().mean())
        else:
            rows = selector.select(q.float(), kv, layer_state.meta, state.steps)
            if rows is layer_state.chose and layer_state.last is not None:
                chosen = layer_state.last  # a reused selection (retrieval_stride): nothing to redo
            else:
                blocks = rows[0][rows[0] >= 0]
                if int(blocks[-1]) != n - 1:  # windows guarantee it; a selection must end where attention does
                    blocks = torch.unique(torch.cat([blocks, torch.tensor([n - 1])]))
                chosen = Selection(blocks, block_ids[blocks])
                layer_state.chose, layer_state.last = rows, chosen
            layer_state.last_blocks = n
            attended = len(chosen.blocks)
        stats = self.stats
        stats.attended += attended
        stats.available += n
        stats.selections += 1
        stats.seconds += time.perf_counter() - started
        return chosen

    def _flush(self) -> None:
        """Publish the last step's counts (once per step: per-layer updates would cost more than
        the selection)."""
        s, algo = self.stats, self.config.algorithm
        if s.selections or s.requests:
            metrics.SPARSE_REQUESTS.labels(algo).inc(s.requests)
            metrics.SPARSE_BLOCKS_ATTENDED.labels(algo).inc(s.attended)
            metrics.SPARSE_BLOCKS_AVAILABLE.labels(algo).inc(s.available)
            metrics.SPARSE_SELECTION_SECONDS.labels(algo).observe(s.seconds)
            t = self.totals
            t.requests, t.attended, t.available = (
                t.requests + s.requests,
                t.attended + s.attended,
                t.available + s.available,
            )
            t.seconds, t.selections = t.seconds + s.seconds, t.selections + s.selections
        self.stats = StepStats()
