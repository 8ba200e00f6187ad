"""Sparse off-load, the scheduler's half: which decoding requests give up their middle blocks.

A request decoding sparsely attends its sink and local windows and a budget of other blocks per
step; the rest of its context only has to be *scored*. Once such a request decodes (its second
decode step: it is then followed from step to step by the worker's sparse runtime), this planner
frees its logical blocks ``[init, n - local)`` from vLLM's KV cache manager (vLLM's own primitive
for a request's freed middle, the one sliding-window attention uses: the entries become the null
block) and takes ``K`` fresh blocks for it (its *slots*: the most arena blocks any of its selections
can keep, for the longest it may grow). The step's metadata tells the workers, which move the
freed blocks' bytes and summaries to their host arena before the step's forward
(``ucm.sparse.serving.SparseRuntime.offload``); vLLM hands the freed blocks out from the next step
on. Arena blocks are numbered here, the same on every worker.

What a request gives back is ``F - K`` blocks (``F`` freed), so the cache holds more long requests
at once; the bytes moved are the request's middle blocks, once, and per step each layer copies the
kept arena blocks into the slots (on a CPU engine the arena and the cache share one memory).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ucm.integration.vllm.metadata import OffloadMove, UCMConnectorMetadata
from ucm.integration.vllm.stats import StatsRecorder
from ucm.sparse.config import SparseConfig

logger = logging.getLogger(__name__)


class OffloadPlanner:
    def __init__(self, config: SparseConfig, block_size: int, stats: StatsRecorder) -> None:
        self.config = config
        self._stats = stats
        self.block_size = block_size
        self.init, self.local = config.options.windows(block_size)
        self._free_arena = list(range(config.offload_blocks - 1, -1, -1))  # popped from the end: 0 first
        self._held: dict[str, tuple[list[int], list[Any]]] = {}  # request -> (its arena blocks, its slots)
        self._manager: Any = None  # vLLM's single-type manager of the model's full-attention layers
        self._pool: Any = None
        self._released: list[str] = []  # since the last step's metadata

    def bind(self, kv_cache_manager: Any) -> None:
        """vLLM's KV cache manager (``KVConnectorBase_V1.bind_kv_cache_manager``)."""
        managers = kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1 or type(managers[0]).__name__ != "FullAttentionManager":
            kinds = ", ".join(type(m).__name__ for m in managers)
            raise RuntimeError(f"sparse.offload_blocks: needs one group of full-attention layers, not {kinds}")
        self._manager = managers[0]
        self._pool = kv_cache_manager.block_pool

    def plan(self, scheduler_output: Any, requests: Mapping[str, Any], meta: UCMConnectorMetadata) -> None:
        """This step's off-loads, and the block each off-loaded request of the step writes into."""
        for req_id in scheduler_output.preempted_req_ids or ():
            self.release(req_id)
        meta.released = self._take_released()
        if self._manager is None:
            return
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = scheduler_output.num_scheduled_tokens
        for i, req_id in enumerate(cached.req_ids):
            request = requests.get(req_id)
            computed = cached.num_computed_tokens[i]
            if request is None or scheduled[req_id] != 1 or req_id in cached.resumed_req_ids:
                continue
            blocks = self._manager.req_to_blocks[req_id]
            if req_id not in self._held:
                self._consider(meta, req_id, request, computed, blocks)
            if req_id in self._held:
                meta.offloaded[req_id] = blocks[computed // self.block_size].block_id

    def _consider(
        self, meta: UCMConnectorMetadata, req_id: str, request: Any, computed: int, blocks: list[Any]
    ) -> None:
        """Off-load the request now if it decodes sparsely and gives back more than its slots."""
        # The worker's runtime decodes a request sparsely from the step after its first long one (a
        # prompt's last token computed alone after a cached prompt attends densely): wait for both.
        if computed <= request.num_prompt_tokens or computed < self.config.min_tokens:
            return
        seq, b = computed + 1, self.block_size
        n = -(-seq // b)
        last = n - self.local
        freed = last - self.init
        longest = -(-(request.num_prompt_tokens + (request.max_tokens or 0)) // b)
        budget = int(self.config.options.budget_blocks(torch.tensor([max(longest, n)]), b)[0])
        k = max(0, budget - self.init - self.local)
        if freed <= k or freed > len(self._free_arena) or k > self._pool.get_num_free_blocks():
            return
        if any(block.is_null for block in blocks[self.init : last]):
            return
        moved = [block.block_id for block in blocks[self.init : last]]
        given = sum(block.ref_cnt == 1 for block in blocks[self.init : last])  # others' prefix blocks stay
        slots = self._pool.get_new_blocks(k)
        self._manager._remove_blocks_in_range(req_id, self.init, last)
        arena = [self._free_arena.pop() for _ in range(freed)]
        self._held[req_id] = (arena, slots)
        meta.offloads.append(OffloadMove(req_id, self.init, moved, arena, [s.block_id for s in slots]))
        self._stats.add("sparse_offloaded_blocks", freed)
        self._stats.add("sparse_offload_blocks_saved", given - k)
        logger.debug("sparse off-load: %s gives %d blocks to the host arena, keeps %d slots", req_id, freed, k)

    def release(self, req_id: str) -> None:
        """A request ended or was preempted: its slots go back to vLLM, its arena blocks free."""
        held = self._held.pop(req_id, None)
        if held is None:
            return
        arena, slots = held
        self._pool.free_blocks(slots)
        self._free_arena.extend(arena)
        self._released.append(req_id)

    def _take_released(self) -> list[str]:
        released, self._released = self._released, []
        return released
