"""Sparse attention in a serving engine: which rows of a step decode sparsely, and the blocks each of
their KV heads attends in each layer. Torch only; ``ucm.integration.vllm.attention`` calls it from
inside vLLM's attention backend.

Once per step, :meth:`SparseRuntime.plan` looks at the batch: a row decodes sparsely when it computes
one token (a decode) and its context has at least ``min_tokens``; prefill chunks and short requests
stay dense, in the same batch. The plan fixes, for every sparse row, how many blocks each KV head
attends (the budget; the same in every layer), hence the lengths the attention kernel sees, so the
kernel's schedule is computed once per step. All of it is tensor arithmetic over the batch: no
Python loop over requests or layers.

Per layer, :meth:`SparseRuntime.select` makes the layer's block table: one native call scores every
(request, KV head, block) and keeps the best (:mod:`ucm.sparse.summaries`). With
``retrieval_stride`` s, a request retrieves every s-th step and otherwise reuses its previous
selection plus the block it started since. A running request is recognized from one step to the
next by the physical block it writes into (a partly filled block belongs to one request only) and
its length growing by one; anything else starts afresh.

The first ``dense_layers`` layers always attend densely (their attention is broad, and later layers'
selections depend on them).

Off-load (``offload_blocks``): the connector's scheduler half frees a decoding request's middle
blocks from the paged cache and gives it a few fresh blocks instead (its *slots*); the worker half
moves those blocks' bytes, summaries and observed attention to a host arena (:meth:`offload`) before
the step's forward. From then on the request's table names arena blocks as ids ``P + v`` (``P``:
the cache's blocks), the summaries are kept for ``P + V`` blocks, so selection is unchanged, and
each layer copies the arena blocks a selection keeps into the request's slots (one per KV head and
kept block) before attending: the same blocks in the same order, so the same output as without
off-load. A dense layer reads every block of an off-loaded request where it lies: the layer's arena
holds the middle, and a scratch region behind it a copy of the step's resident blocks (the sink and
the newest blocks, a few), so that one kernel call attends them all (:meth:`offloaded_cache`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ucm import metrics
from ucm.config import ConfigError
from ucm.hugepages import huge_zeros
from ucm.sparse.config import SparseConfig
from ucm.sparse.summaries import BlockSummaries, Scoring, fetch_into_slots

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """``model.layers.7.self_attn.attn`` -> 7."""
    found = _LAYER_INDEX.search(layer_name)
    if found is None:
        raise ValueError(f"sparse: cannot tell the layer index of {layer_name!r}")
    return int(found.group(1))


# The sparse runtime of each attention layer in this process (one runtime per KV cache group): the
# cache writer and the connector reach it by layer name, the forward pass through the step's metadata.
RUNTIMES: dict[str, SparseRuntime] = {}


def invalidate_summaries(blocks: list[int]) -> None:
    """Blocks whose bytes are written without the attention backend (a connector load): their
    summaries are recomputed from the cache before they are next scored."""
    if blocks and RUNTIMES:
        ids = torch.tensor(blocks, dtype=torch.long)
        for runtime in {id(r): r for r in RUNTIMES.values()}.values():
            runtime.invalidate(ids)


def offloading_runtimes() -> list[SparseRuntime]:
    """The runtimes of this process that off-load (``offload_blocks``)."""
    return [r for r in {id(r): r for r in RUNTIMES.values()}.values() if r.host_blocks]


@dataclass
class Offloaded:
    """A decoding request whose middle blocks live in the host arena."""

    first: int  # the first off-loaded logical block
    arena: torch.Tensor  # (F,) long: the arena blocks holding logical blocks first, first + 1, ...
    slots: torch.Tensor  # (K,) long: cache blocks its kept arena blocks are attended through
    writing: int = -1  # the block it wrote into in its last step


@dataclass
class OffloadedRows:
    """The step's off-loaded requests as a dense layer attends them: every block, through the
    layer's arena with the step's resident blocks copied behind it (:meth:`SparseRuntime.offloaded_cache`)."""

    rows: torch.Tensor  # (O,) long: their rows of the batch
    tokens: torch.Tensor  # (O,) long: each row's query token
    seq_lens: torch.Tensor  # (O,) int32
    tables: torch.Tensor  # (O, W) int32: blocks of the arena, then scratch blocks V, V + 1, ...
    copy_from: torch.Tensor  # (S,) long: the resident cache blocks those scratch blocks copy, in order


@dataclass
class StepPlan:
    """What every sparse layer of one step shares. ``R`` sparse rows, ``Hkv`` KV heads."""

    rows: torch.Tensor  # (R,) long: the rows of the batch that decode sparsely
    tokens: torch.Tensor  # (R,) int32: each row's query token
    seq_lens: torch.Tensor  # (R,) int32
    tables: torch.Tensor  # (R, W) int32: physical blocks, logical order
    retrieve: torch.Tensor  # (R,) int32: blocks a retrieval keeps (the budget)
    kept: torch.Tensor  # (R,) long: blocks each KV head attends this step
    kept_total: float  # kept.sum(), as the step's counters took it
    lens: torch.Tensor  # (R * Hkv,) int32: the lengths the per-head attention kernel sees
    partial: torch.Tensor  # (R * Hkv,) int32: the last block's tokens minus a block; lens = kept * block + this
    width: int  # columns of a layer's table
    due: torch.Tensor | None  # (D,) long: rows that retrieve; None: all of them
    reused: torch.Tensor | None  # (R - D,) long: rows that reuse their selection
    previous: torch.Tensor | None  # (R - D,) long: those rows' rows in the previous step
    grown: torch.Tensor | None  # (R - D,) bool: reused rows that started a new block since
    stale: torch.Tensor  # (S,) int32: full blocks whose summaries must be recomputed first
    fixed: torch.Tensor | None = None  # static selection: the table every layer uses
    slots: torch.Tensor | None = None  # (R, K) long: each row's slots (-1: none); None: nothing off-loaded
    offloaded: OffloadedRows | None = None  # for the dense layers; None: nothing off-loaded or no dense layer


@dataclass
class StepStats:
    requests: int = 0  # requests that started decoding sparsely
    attended: float = 0  # blocks attended per KV head, summed over requests and layers (dense layers too)
    available: int = 0  # blocks those requests hold, summed the same way
    seconds: float = 0.0  # spent selecting (scoring, top-k, refreshing summaries)
    retrievals: int = 0  # (request, layer) selections computed afresh
    decodes: int = 0  # decode tokens on the sparse path
    short: int = 0  # decode tokens kept dense: their request is shorter than min_tokens
    first: int = 0  # decode tokens kept dense: the prompt's last token (the rest was cached)


class SparseRuntime:
    def __init__(
        self,
        config: SparseConfig,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        layer_names: list[str],
        key_positions: torch.Tensor | None = None,
    ) -> None:
        """``key_positions``: where token ``t``, channel ``d`` of a block's keys lies in one head's
        keys as the cache stores them (``positions[t * head_dim + d]``); needed to observe prompts."""
        self.config = config
        options = config.options
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.layer_names = layer_names
        self.num_layers = len(layer_names)
        self.dense_layers = sum(not self.sparse_layer(name) for name in layer_names)
        try:  # fail at startup, not at the first long request (e.g. hash_bits > head_dim)
            self.scoring: Scoring | None = options.scoring(head_dim)
        except ValueError as exc:
            raise ConfigError(f"sparse.{config.algorithm}.{exc}") from None
        self.windows = options.windows(block_size)
        self.stride = getattr(options, "retrieval_stride", 1)
        self.window = getattr(options, "observation_window", 0) if self.scoring is not None else 0
        if self.window and key_positions is None:
            raise ValueError("sparse: observation_window needs the cache's key positions")
        self.key_positions = None if key_positions is None else key_positions.long()
        self.priors: dict[str, torch.Tensor] = {}  # per layer, (P, Hkv) float32: see observe
        self.observed = torch.empty(0, dtype=torch.long)  # the step's rows observe reads (begin_step)
        self.summaries: dict[str, BlockSummaries] = {}
        self._previous: dict[str, torch.Tensor] = {}  # each layer's last table
        # Per physical block: the length, plan row and steps since retrieval of the request that
        # last wrote into it (-1: none), for the rows of the previous step only.
        self._seq = self._row = self._age = torch.empty(0, dtype=torch.int32)
        # Per physical block: the length of the off-loaded request that last wrote into it (-1: none),
        # kept while it runs, skipped steps included: it must decode sparsely whenever it comes back.
        self._held = torch.empty(0, dtype=torch.int32)
        self._written = torch.empty(0, dtype=torch.long)
        self._previous_kept = torch.empty(0, dtype=torch.long)
        self.stats = StepStats()
        self.totals = StepStats()  # since start, for tests and benchmarks
        self.plan: StepPlan | None = None
        self.host_blocks = config.offload_blocks
        self.resident = 0  # blocks of the paged cache (allocate_arena); arena block v is block resident + v
        # Per layer, (V * Hkv, 2 * block, D): see allocate_arena; a dense layer's has scratch planes behind.
        self.arena: dict[str, torch.Tensor] = {}
        self._zeros: Callable[..., torch.Tensor] = torch.zeros  # the arena's allocation (allocate_arena)
        self.scratch_blocks = 0  # the dense layers' scratch, in blocks (grown as a step needs)
        # Per layer: the arena plane each cache plane holds (-1: none), and the slot holding each
        # arena plane (-1: none): what a layer's slots hold from one step to the next (see _fetch).
        self._holds: dict[str, torch.Tensor] = {}
        self._slot_of: dict[str, torch.Tensor] = {}
        self.offloaded: dict[str, Offloaded] = {}  # by request id
        self.fetched = 0  # (block, KV head) planes copied from the arena into slots, since start

    def sparse_layer(self, layer_name: str) -> bool:
        return layer_index(layer_name) >= self.config.dense_layers

    # -- summaries -------------------------------------------------------------------------------
    def write(self, layer_name: str, keys: torch.Tensor, slots: torch.Tensor, num_blocks: int, dtype: torch.dtype):
        """Keys just written into the cache at ``slots``: fold them into the layer's summaries."""
        if self.scoring is None:
            return
        num_blocks += self.host_blocks
        summaries = self.summaries.get(layer_name)
        if summaries is None or summaries.num_blocks != num_blocks:
            summaries = self.summaries[layer_name] = BlockSummaries(
                self.scoring, num_blocks, self.block_size, self.num_kv_heads, self.head_dim, dtype
            )
        summaries.write(keys[: len(slots)], slots)
        prior = self.priors.get(layer_name)
        if prior is not None:  # a block started afresh holds no observed prompt's attention (yet)
            fresh = slots[(slots >= 0) & (slots % self.block_size == 0)]
            if len(fresh):
                prior[fresh // self.block_size] = 0

    def observe(
        self,
        layer_name: str,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
    ) -> None:
        """The prompt's own attention where it ends (SnapKV's observation window): for each row of
        the step computing a prompt chunk of a request of at least ``min_tokens``, or a prompt's last
        token computed alone (dense, :meth:`begin_step`), the attention its last ``observation_window``
        query tokens give each block, exactly, averaged over those tokens and summed over the query
        heads of each KV head (the scale of a selection's block scores).
        :meth:`select` adds it to every later decode step's scores: what the question at the end of
        a prompt looked at (a needle in it) stays attended, whatever the block summaries estimate.

        Kept by physical block (the last chunk of a prompt writes all its blocks; a prefix shared by
        several requests holds the last one's); a block started afresh is zeroed (:meth:`write`).
        One computation per prompt chunk and layer, a Python loop over the step's prompt chunks."""
        if not self.window or not len(self.observed):
            return
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        assert self.key_positions is not None
        b, hkv, d = self.block_size, self.num_kv_heads, self.head_dim
        prior = self.priors.get(layer_name)
        if prior is None or len(prior) != len(key_cache) + self.host_blocks:
            prior = self.priors[layer_name] = torch.zeros(len(key_cache) + self.host_blocks, hkv, dtype=torch.float32)
        for r in self.observed.tolist():
            end, seq = int(query_start_loc[r + 1]), int(seq_lens[r])
            w, n = min(self.window, int(query_lens[r])), (seq + b - 1) // b
            blocks = block_table[r, :n].long()
            stored = key_cache[blocks].reshape(n, hkv, b * d)[:, :, self.key_positions]
            keys = stored.view(n, hkv, b, d).transpose(0, 1).reshape(hkv, n * b, d).float()
            q = query[end - w : end].reshape(w, hkv, -1, d).float()
            logits = torch.einsum("whgd,htd->hgwt", q, keys) * scale
            hidden = torch.arange(n * b)[None, :] > (seq - w + torch.arange(w))[:, None]  # causal, and past seq
            share = logits.masked_fill_(hidden, float("-inf")).softmax(-1).mean(2).sum(1)  # (Hkv, T)
            prior[blocks] = share.view(hkv, n, b).sum(-1).T

    def invalidate(self, blocks: torch.Tensor) -> None:
        """Blocks written without the attention backend (loaded from a store): their summaries are
        recomputed from the cache before they are scored."""
        for summaries in self.summaries.values():
            summaries.invalidate(blocks)

    # -- off-load --------------------------------------------------------------------------------
    def allocate_arena(self, kv_caches: dict[str, torch.Tensor], huge_pages: bool = False) -> None:
        """The host arena, once, beside the paged cache (``kv_caches``: each layer's, as registered),
        on 2 MiB pages with ``huge_pages`` (its blocks are read scattered, as the cache's)."""
        self._zeros = huge_zeros if huge_pages else torch.zeros
        for name in self.layer_names:
            cache = kv_caches[name]
            self.resident = len(cache)
            planes = cache_planes(cache)
            self.arena[name] = self._zeros(self.host_blocks * self.num_kv_heads, *planes.shape[1:], dtype=cache.dtype)
            if self.sparse_layer(name):
                self._holds[name] = torch.full((len(planes),), -1, dtype=torch.int32)
                self._slot_of[name] = torch.full((len(self.arena[name]),), -1, dtype=torch.int32)

    def _grow_scratch(self, blocks: int) -> None:
        """At least ``blocks`` scratch blocks behind each dense layer's arena (doubling: a copy of the
        arena each time, a few times in an engine's life)."""
        if blocks <= self.scratch_blocks:
            return
        self.scratch_blocks = max(blocks, 2 * self.scratch_blocks)
        rows = (self.host_blocks + self.scratch_blocks) * self.num_kv_heads
        for name in self.layer_names:
            if not self.sparse_layer(name):
                arena = self.arena[name]
                grown = self._zeros(rows, *arena.shape[1:], dtype=arena.dtype)
                grown[: self.host_blocks * self.num_kv_heads] = arena[: self.host_blocks * self.num_kv_heads]
                self.arena[name] = grown

    def offload(
        self,
        req_id: str,
        first: int,
        blocks: list[int],
        arena: list[int],
        slots: list[int],
        kv_caches: dict[str, torch.Tensor],
    ) -> None:
        """Logical blocks ``first, first + 1, ...`` of a request, in cache ``blocks``, move to ``arena``
        blocks; it attends them through cache ``slots`` from now on. Runs before the step's forward:
        the scheduler freed ``blocks`` this step, so nothing overwrote them yet."""
        if not self.arena:
            raise RuntimeError("sparse off-load: the host arena was not allocated (register_kv_caches)")
        source, target = torch.tensor(blocks, dtype=torch.long), torch.tensor(arena, dtype=torch.long)
        hkv, heads = self.num_kv_heads, torch.arange(self.num_kv_heads)
        rows_from = (source[:, None] * hkv + heads).flatten()
        rows_to = (target[:, None] * hkv + heads).flatten()
        own = torch.tensor(slots, dtype=torch.long)  # none when its budget is its windows
        slot_planes = (own[:, None] * hkv + heads).flatten()
        for name in self.layer_names:
            self.arena[name][rows_to] = cache_planes(kv_caches[name])[rows_from]
            if not self.sparse_layer(name):
                continue
            self._holds[name][slot_planes] = -1  # fresh slots hold nothing yet; the arena blocks are in none
            self._slot_of[name][rows_to] = -1
            summaries = self.summaries.get(name)
            if summaries is not None:
                summaries.copy_rows(source, self.resident + target)
            prior = self.priors.get(name)
            if prior is not None:
                prior[self.resident + target] = prior[source]
        moved = torch.full((self.resident,), -1, dtype=torch.long)
        moved[source] = self.resident + target
        for previous in self._previous.values():  # a selection reused next step names the arena
            block = previous.long() // hkv
            off = (block < self.resident) & (moved[block.clamp(max=self.resident - 1)] >= 0)
            previous[off] = (moved[block[off]] * hkv + previous[off].long() % hkv).to(torch.int32)
        self.offloaded[req_id] = Offloaded(first, target, own)

    def release(self, req_ids: list[str]) -> None:
        """Requests that ended or were preempted: their arena blocks and slots are someone else's now."""
        for req_id in req_ids:
            state = self.offloaded.pop(req_id, None)
            if state is not None and state.writing >= 0:
                self._held[state.writing] = -1

    def place_offloaded(self, writing: dict[str, int]) -> None:
        """Before the step's forward: each off-loaded request of the step, found by the block it
        writes into (``writing``), has its table name its arena blocks and its slots set."""
        plan = self.plan
        if not writing:
            return
        if plan is None or plan.fixed is not None:
            raise RuntimeError(f"sparse off-load: {len(writing)} off-loaded requests in a step with no sparse plan")
        b = self.block_size
        at = torch.arange(len(plan.rows))
        row_of = {int(w): r for r, w in enumerate(plan.tables[at, (plan.seq_lens.long() - 1) // b].tolist())}
        width = max(len(self.offloaded[req_id].slots) for req_id in writing)
        slots = torch.full((len(plan.rows), width), -1, dtype=torch.long)
        for req_id, block in writing.items():
            r = row_of.get(block)
            if r is None:  # it would attend cache blocks that hold other requests' keys now
                raise RuntimeError(f"sparse off-load: request {req_id} is not decoding sparsely this step")
            state = self.offloaded[req_id]
            plan.tables[r, state.first : state.first + len(state.arena)] = (self.resident + state.arena).to(torch.int32)
            slots[r, : len(state.slots)] = state.slots
            if state.writing >= 0:
                self._held[state.writing] = -1
            state.writing = block
            self._held[block] = plan.seq_lens[r]
        plan.slots = slots
        n = (plan.seq_lens.long() + b - 1) // b
        plan.stale = self._stale(plan.tables, n)
        if self.dense_layers:
            rows = torch.tensor(sorted(row_of[block] for block in writing.values()), dtype=torch.long)
            plan.offloaded = self._offloaded_rows(plan, rows, n[rows])

    def _offloaded_rows(self, plan: StepPlan, rows: torch.Tensor, n: torch.Tensor) -> OffloadedRows:
        """Plan rows ``rows`` (off-loaded, ``n`` blocks each) as the dense layers attend them: arena
        block ``v`` stays ``v``, and each resident block gets a scratch block of its own behind the arena."""
        tables = plan.tables[rows].long()
        used = torch.arange(tables.shape[1])[None, :] < n[:, None]
        resident = used & (tables < self.resident)
        copy_from = tables[resident]
        self._grow_scratch(len(copy_from))
        tables = torch.where(used, tables - self.resident, 0)
        tables[resident] = self.host_blocks + torch.arange(len(copy_from))
        return OffloadedRows(
            rows=plan.rows[rows],
            tokens=plan.tokens[rows].long(),
            seq_lens=plan.seq_lens[rows],
            tables=tables.to(torch.int32),
            copy_from=copy_from,
        )

    def offloaded_cache(self, layer_name: str, kv_cache: torch.Tensor) -> torch.Tensor:
        """A dense layer's blocks of the step's off-loaded requests, shaped as the kernel reads a cache,
        ``(V + scratch, Hkv, 2 * block, D)`` (``plan.offloaded.tables`` index it): the arena, with
        the resident blocks they attend copied into the scratch behind it (after this step's keys
        were written)."""
        assert self.plan is not None and self.plan.offloaded is not None
        copy_from, arena = self.plan.offloaded.copy_from, self.arena[layer_name]
        blocks = arena.view(-1, self.num_kv_heads * arena[0].numel())  # a block's planes are contiguous
        # Straight into the scratch: 10x faster than indexing planes (an index tensor per plane).
        torch.index_select(
            kv_cache.view(len(kv_cache), -1),
            0,
            copy_from,
            out=blocks[self.host_blocks : self.host_blocks + len(copy_from)],
        )
        return arena.view(-1, self.num_kv_heads, *arena.shape[1:])

    def _stale(self, tables: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """The full blocks of these rows (``n`` blocks each) whose summaries must be recomputed
        before they are scored; arena blocks are never stale."""
        if not self.summaries:
            return torch.empty(0, dtype=torch.int32)
        return next(iter(self.summaries.values())).stale(tables, n - 1, self.resident or None)

    def _fetch(self, layer_name: str, plan: StepPlan, table: torch.Tensor, planes: torch.Tensor) -> None:
        """Arena blocks in the layer's table, copied into their rows' slots unless a slot holds one
        already from an earlier step (a selection changes little from one step to the next), and
        the table pointed at the slots."""
        assert plan.slots is not None
        self.fetched += fetch_into_slots(
            table, plan.slots, self._holds[layer_name], self._slot_of[layer_name], self.arena[layer_name], planes
        )

    # -- the step --------------------------------------------------------------------------------
    def begin_step(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
    ) -> StepPlan | None:
        """The step's plan, or None when no row decodes sparsely."""
        self._flush()
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        decode = query_lens == 1
        long = seq_lens >= self.config.min_tokens
        self.stats.short += int((decode & ~long).sum())
        self._ensure_tracking(block_table)
        # Long requests are followed from step to step, prompt chunks included.
        tracked = torch.nonzero(long).flatten()
        b, hkv = self.block_size, self.num_kv_heads
        seq = seq_lens[tracked].to(torch.int32)
        n = (seq + b - 1) // b
        tables = block_table[tracked].to(torch.int32).contiguous()
        is_decode = decode[tracked]
        age, previous, sparse = self._track(tables, seq, n, is_decode)
        # A decode row that continues nothing computes the prompt's last token: the rest of the
        # prompt came from the prefix cache or the store (a PD decode engine, a warm prompt). It
        # attends densely, as that token does at the end of a computed prompt, and is observed.
        first = tracked[is_decode & ~sparse]
        self.observed = torch.cat([tracked[~is_decode], first])
        self.stats.first += len(first)
        rows = tracked[sparse]
        if len(rows) == 0:
            self.plan = None
            return None
        seq, n, tables = seq[sparse], n[sparse], tables[sparse].contiguous()
        age, previous = age[sparse], previous[sparse]
        self.stats.requests += int((age == 0).sum())  # their first sparse step
        budget = self.config.options.budget_blocks(n.long(), b).to(torch.int32)
        due_mask = age % self.stride == 0
        if self.scoring is None:  # static: nothing to retrieve
            due_mask = torch.ones_like(due_mask)
        kept = budget.long().clone()
        due = reused = prev_rows = grown = None
        if not bool(due_mask.all()):
            due = torch.nonzero(due_mask).flatten()
            reused = torch.nonzero(~due_mask).flatten()
            prev_rows = previous[reused].long()
            grown = (seq[reused] - 1) % b == 0  # the row's newest block started since the last step
            previous_kept = self._previous_kept[prev_rows]
            kept[reused] = previous_kept + grown.long()
        partial = (seq - n * b).repeat_interleave(hkv)
        lens = torch.add(partial, kept.to(torch.int32).repeat_interleave(hkv), alpha=b)
        stale = self._stale(tables, n.long())
        self.plan = StepPlan(
            rows=rows,
            tokens=query_start_loc[rows].to(torch.int32),
            seq_lens=seq,
            tables=tables,
            retrieve=budget,
            kept=kept,
            kept_total=float(kept.sum()),
            lens=lens,
            partial=partial,
            width=int(kept.max()),
            due=due,
            reused=reused,
            previous=prev_rows,
            grown=grown,
            stale=stale,
        )
        if self.scoring is None:
            self.plan.fixed = self._static_table(self.plan, n.long())
        self._previous_kept = kept
        s = self.stats
        sparse_layers = self.num_layers - self.dense_layers
        s.attended += self.plan.kept_total * sparse_layers + float(n.sum()) * self.dense_layers
        s.available += int(n.sum()) * self.num_layers
        s.retrievals += (len(rows) if due is None else len(due)) * sparse_layers
        s.decodes += len(rows)
        return self.plan

    def select(
        self,
        layer_name: str,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's per-head block table ((R * Hkv, width) int32, rows ``phys * Hkv + head``) and
        the lengths the kernel attends over it ((R * Hkv,) int32: ``plan.lens`` unless adaptive).

        ``query``: the step's (tokens, H, D); ``kv_cache``: the layer's cache as vLLM holds it
        ((P, Hkv, ...), see :meth:`BlockSummaries.refresh` for ``positions``)."""
        plan = self.plan
        assert plan is not None
        if plan.fixed is not None:
            return plan.fixed, plan.lens
        started = time.perf_counter()
        summaries = self.summaries[layer_name]
        if len(plan.stale):
            summaries.refresh(cache_keys(kv_cache), positions, plan.stale)
        hkv = self.num_kv_heads
        prior = self.priors.get(layer_name)
        table = torch.zeros(len(plan.rows) * hkv, plan.width, dtype=torch.int32)
        windows = self.windows
        lens = plan.lens
        assert self.scoring is not None
        if self.scoring.mass > 0:  # adaptive: each (request, KV head) keeps what its estimate needs
            kept = torch.empty(len(plan.rows) * hkv, dtype=torch.int32)
            summaries.select(
                query,
                plan.tokens,
                plan.tables,
                plan.seq_lens,
                plan.retrieve,
                windows,
                scale,
                table,
                mass=self.scoring.mass,
                kept=kept,
                prior=prior,
            )
            lens = torch.add(plan.partial, kept, alpha=self.block_size)  # one op: this runs per layer
            self.stats.attended += float(kept.sum()) / hkv - plan.kept_total  # the plan counted the cap
        elif plan.due is None:
            summaries.select(
                query, plan.tokens, plan.tables, plan.seq_lens, plan.retrieve, windows, scale, table, prior=prior
            )
        else:
            due = plan.due
            if len(due):
                fresh = torch.zeros(len(due) * hkv, plan.width, dtype=torch.int32)
                summaries.select(
                    query,
                    plan.tokens[due].contiguous(),
                    plan.tables[due].contiguous(),
                    plan.seq_lens[due].contiguous(),
                    plan.retrieve[due].contiguous(),
                    windows,
                    scale,
                    fresh,
                    prior=prior,
                )
                table.view(len(plan.rows), hkv, -1)[due] = fresh.view(len(due), hkv, -1)
            self._reuse(layer_name, plan, table)
        if plan.slots is not None:
            self._fetch(layer_name, plan, table, cache_planes(kv_cache))
        self._previous[layer_name] = table
        self.stats.seconds += time.perf_counter() - started
        return table, lens

    def _reuse(self, layer_name: str, plan: StepPlan, table: torch.Tensor) -> None:
        """Rows between retrievals: last step's selection, plus the block each has started since."""
        assert plan.reused is not None and plan.previous is not None and plan.grown is not None
        hkv, r = self.num_kv_heads, len(plan.rows)
        before = self._previous[layer_name]
        per_row = before.view(-1, hkv, before.shape[1])[plan.previous]  # (U, Hkv, w)
        w = min(per_row.shape[2], plan.width)
        view = table.view(r, hkv, -1)
        view[plan.reused, :, :w] = per_row[:, :, :w]
        if bool(plan.grown.any()):
            rows = plan.reused[plan.grown]
            n = (plan.seq_lens[rows].long() + self.block_size - 1) // self.block_size
            newest = plan.tables[rows, n - 1].long() * hkv + torch.arange(hkv)[None, :]  # (G, Hkv)
            column = plan.kept[rows] - 1
            view[rows[:, None], torch.arange(hkv)[None, :], column[:, None]] = newest.to(torch.int32)

    def _static_table(self, plan: StepPlan, n: torch.Tensor) -> torch.Tensor:
        """Sinks and the most recent blocks, no scoring: what a selection costing nothing keeps."""
        init = self.windows[0]
        cols = torch.arange(plan.width)[None, :]
        k = plan.kept[:, None]
        logical = torch.where(cols < init, cols, n[:, None] - k + cols)
        logical = torch.minimum(logical, n[:, None] - 1).clamp(min=0)
        phys = plan.tables.long().gather(1, logical)
        hkv = self.num_kv_heads
        return (phys[:, None, :] * hkv + torch.arange(hkv)[None, :, None]).reshape(-1, plan.width).to(torch.int32)

    # -- request tracking ------------------------------------------------------------------------
    def _ensure_tracking(self, block_table: torch.Tensor) -> None:
        blocks = int(block_table.max()) + 1 if block_table.numel() else 1
        if len(self._seq) < blocks:
            grow = max(blocks, 2 * len(self._seq))
            self._seq = torch.cat([self._seq, torch.full((grow - len(self._seq),), -1, dtype=torch.int32)])
            self._row = torch.cat([self._row, torch.full((grow - len(self._row),), -1, dtype=torch.int32)])
            self._age = torch.cat([self._age, torch.zeros(grow - len(self._age), dtype=torch.int32)])
            self._held = torch.cat([self._held, torch.full((grow - len(self._held),), -1, dtype=torch.int32)])

    def _track(
        self, tables: torch.Tensor, seq: torch.Tensor, n: torch.Tensor, decode: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per tracked row: steps since its first sparse step, its row in the previous plan, and
        whether it decodes sparsely: a decode continuing a request of the previous step (a decode
        or a prompt chunk); its first sparse step (age 0) retrieves."""
        idx = torch.arange(len(seq))
        writing = tables[idx, n.long() - 1].long()
        before = tables[idx, (n.long() - 2).clamp(min=0)].long()
        here = self._seq[writing] == seq - 1
        started = (n >= 2) & ((seq - 1) % self.block_size == 0)
        moved = ~here & started & (self._seq[before] == seq - 1)
        source = torch.where(moved, before, writing)
        # An off-loaded request back after a step without it: sparse, and retrieving afresh.
        back = ~(here | moved) & ((self._held[writing] == seq - 1) | (started & (self._held[before] == seq - 1)))
        sparse = decode & (here | moved | back)
        age = torch.where(sparse, self._age[source] + 1, torch.full_like(seq, -1))
        age = torch.where(back, 0, age)
        previous = torch.where(sparse, self._row[source], torch.full_like(seq, -1))
        self._forget()
        self._seq[writing] = seq
        self._row[writing] = torch.where(sparse, sparse.int().cumsum(0) - 1, -1).to(torch.int32)
        self._age[writing] = age
        self._written = writing
        return age, previous, sparse

    def _forget(self) -> None:
        if len(self._written):
            self._seq[self._written] = -1
            self._written = torch.empty(0, dtype=torch.long)

    def _flush(self) -> None:
        """Publish the last step's counts (once per step: per-layer updates would cost more than
        the selection)."""
        s, algo = self.stats, self.config.algorithm
        if s.short:
            metrics.SPARSE_DECODE_TOKENS.labels(algo, "dense_short").inc(s.short)
            self.totals.short += s.short
        if s.first:
            metrics.SPARSE_DECODE_TOKENS.labels(algo, "dense_first").inc(s.first)
            self.totals.first += s.first
        if s.retrievals or s.requests or s.available:
            metrics.SPARSE_DECODE_TOKENS.labels(algo, "sparse").inc(s.decodes)
            self.totals.decodes += s.decodes
            metrics.SPARSE_REQUESTS.labels(algo).inc(s.requests)
            metrics.SPARSE_BLOCKS_ATTENDED.labels(algo).inc(s.attended)
            metrics.SPARSE_BLOCKS_AVAILABLE.labels(algo).inc(s.available)
            metrics.SPARSE_SELECTION_SECONDS.labels(algo).observe(s.seconds)
            t = self.totals
            t.requests += s.requests
            t.attended += s.attended
            t.available += s.available
            t.seconds += s.seconds
            t.retrievals += s.retrievals
        self.stats = StepStats()


def cache_planes(kv_cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache as one row per (block, KV head): its keys and values, ``(P * Hkv, 2 * block, D)``."""
    num_blocks, hkv, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks * hkv, 2 * block_size, -1)


def cache_keys(kv_cache: torch.Tensor) -> torch.Tensor:
    """The keys of a layer's cache, per block and KV head: ``(blocks, kv_heads, block_size, head_dim)``
    as stored (``ucm.integration.vllm.attention.learn_layout`` says where each element lies)."""
    num_blocks, hkv, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, hkv, 2 * block_size, -1)[:, :, :block_size]
