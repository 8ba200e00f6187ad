"""The scheduler half of the connector: which blocks to load and which to save, per step.

It runs in vLLM's scheduler process and only decides; workers move the bytes. A request's prompt
is hashed once (ids are kept for the request's lifetime), the store is asked for the longest
stored prefix, blocks beyond vLLM's own prefix-cache hit are loaded, and every prompt block that
becomes full and is not yet stored is saved. Its ids name its own inputs beside its tokens (its
``cache_salt``, its LoRA adapter by content); a request whose KV its tokens cannot name
(multimodal inputs, prompt embeddings, an adapter that cannot be fingerprinted) bypasses the store.

vLLM asks for every waiting request in one scheduler step, and the step waits for all answers: the
lookups of one step share one deadline (``lookup_timeout_s`` from the step's first lookup). Once
it has passed, the step's remaining requests count as misses at once and are recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ucm.hashing import BlockHasher, HashContext
from ucm.integration.vllm.chunks import explicit_chunks, split_chunks
from ucm.integration.vllm.config import BlendConfig
from ucm.integration.vllm.events import StoreEvents
from ucm.integration.vllm.health import StoreHealth
from ucm.integration.vllm.identity import Adapters
from ucm.integration.vllm.metadata import BlendTransfer, BlockTransfer, UCMConnectorMetadata, rank_keys, store_keys
from ucm.integration.vllm.stats import StatsRecorder
from ucm.store import Store
from ucm.store.deadline import Deadlined

logger = logging.getLogger(__name__)
HASHERS_KEPT = 256

# kv_transfer_params keys. A producer answers with PARAM_BLOCKS so a consumer knows what to wait for;
# a consumer answers with PARAM_LOADED, the prompt tokens the store gave it (the proxy's PD path check
# reads it: vLLM's usage reports the *prefill's* cached tokens on a decode).
PARAM_BLOCKS = "ucm_blocks"
PARAM_LOADED = "ucm_loaded_tokens"
# A producer that blended the prompt answers with [Blend's settings fingerprint, first blended block]:
# its blocks from there on are stored under ids of that blend, and the consumer loads those.
PARAM_BLEND = "ucm_blend"
# A client's chunk boundaries for Blend (token offsets; see chunks.explicit_chunks), instead of separators.
PARAM_CHUNKS = "ucm_chunks"


class RequestLike(Protocol):
    """The fields of vLLM's Request that the scheduler half reads."""

    request_id: str
    prompt_token_ids: Sequence[int] | None
    all_token_ids: Sequence[int]  # prompt and generated so far (vLLM appends to it in place)
    num_tokens: int
    kv_transfer_params: dict[str, Any] | None
    cache_salt: str | None
    # Also read when present, as vLLM's Request has them: lora_request, prompt_embeds, mm_features.


@dataclass
class _RequestState:
    request: RequestLike  # vLLM's live request: its tokens grow as it decodes
    inputs: _Inputs  # what besides its tokens names its blocks
    hashes: list[bytes]  # block ids of its full blocks so far (prompt, then decoded)
    ids: list[bytes]  # the same as store keys (rank 0)
    num_prompt_tokens: int
    stored: int = 0  # leading blocks present in the store at the last lookup
    load: tuple[int, int] | None = None  # blocks [start, end) to load once vLLM allocated them
    load_tokens: int = 0  # tokens those blocks give vLLM (one less than the blocks on a full hit)
    loaded_tokens: int = 0  # tokens handed to workers to load so far (a failed load is recomputed by vLLM)
    blocks: list[int] = field(default_factory=list)  # vLLM block ids of the request
    next_save: int = 0  # first block not yet handed to workers for saving
    wait_started: float | None = None
    announced: bool = False  # its lookup's result went out as KV events
    blend: _BlendPlan | None = None  # a region to blend once vLLM allocated its blocks
    blend_from: int | None = None  # first block of approximate KV (blended): named by the blend's ids
    chunks_refused: bool = False  # its ucm_chunks was malformed (refused once)


@dataclass(frozen=True)
class _Inputs:
    """A request's own inputs that its block ids name beside its tokens."""

    salt: str = ""  # its cache_salt
    adapter: str = ""  # its LoRA adapter's identity (identity.Adapters)
    lora_name: str | None = None  # the adapter's name, as vLLM's KV events carry it

    @property
    def event_keys(self) -> tuple[str | None, str | None]:
        return self.lora_name, self.salt or None


@dataclass
class _BlendPlan:
    end: int  # the region is [0, end)
    computed: int  # leading tokens exact once the step's loads are done
    chunks: list[tuple[int, list[bytes]]]  # (position, rank-0 keys of its leading stored blocks)
    missed: int  # chunks of a full block or more that the store did not have


@dataclass(frozen=True)
class BlendSettings:
    config: BlendConfig
    separator: tuple[int, ...]  # the separator's tokens (the model's tokenizer, the text alone)

    @property
    def fingerprint(self) -> str:
        """Names blocks this blend made (``HashContext.blend``): another ratio makes other KV."""
        settings = json.dumps(self.config.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(settings.encode()).hexdigest()[:16]


class SchedulerSide:
    def __init__(
        self,
        context: HashContext,
        store: Store,
        *,
        can_load: bool,
        can_save: bool,
        pd_wait_timeout_s: float,
        stats: StatsRecorder,
        tp_size: int = 1,
        clock: Any = time.monotonic,
        lookup_timeout_s: float = 2.0,
        decode_save_blocks: int = 0,
        health: StoreHealth | None = None,
        events: StoreEvents | None = None,
        blend: BlendSettings | None = None,
        adapters: Adapters | None = None,
    ) -> None:
        self._context = context
        self._hashers: dict[tuple[str, str, str], BlockHasher] = {}
        self._store = store
        self._can_load = can_load
        self._can_save = can_save
        self._timeout = pd_wait_timeout_s
        self._stats = stats
        self._tp_size = tp_size
        self._clock = clock
        self._requests: dict[str, _RequestState] = {}
        self.block_size = context.block_size
        health = health or StoreHealth(None)
        self._lookups = Deadlined(lookup_timeout_s, "UCM lookup", on_stuck=health.stuck, on_answer=health.answered)
        # When this step's lookups must be done (time.monotonic: real waits, not the injected clock);
        # None until the step's first lookup.
        self._step_deadline: float | None = None
        self._decode_save_blocks = decode_save_blocks
        self._saves_failing = False
        self._events = events  # None: vLLM publishes no KV events
        self._blend = blend
        self._adapters = adapters or Adapters(None)

    def _hasher(self, inputs: _Inputs, blend: str = "") -> BlockHasher:
        """One hasher per request salt, adapter and blend, the most recently used ``HASHERS_KEPT``
        kept: clients choose salts, so the cache must not grow with them."""
        key = (inputs.salt, inputs.adapter, blend)
        hasher = self._hashers.pop(key, None) or BlockHasher(
            self._context.for_request(inputs.salt, blend, inputs.adapter)
        )
        self._hashers[key] = hasher  # most recent last
        if len(self._hashers) > HASHERS_KEPT:
            del self._hashers[next(iter(self._hashers))]
        return hasher

    def _state(self, request: RequestLike) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = list(request.prompt_token_ids or [])
            inputs = self._inputs(request)
            ids = [] if inputs is None else self._hasher(inputs).block_ids(prompt)
            blended = _blended_params(request)
            if blended is not None and ids:  # a PD consumer of a prompt its producer blended
                assert inputs is not None
                fingerprint, first = blended
                ids = ids[:first] + self._hasher(inputs, fingerprint).block_ids(prompt)[first:]
            keys = store_keys(ids, 0, self._tp_size)
            state = _RequestState(request, inputs or _Inputs(), ids, keys, len(prompt))
            self._requests[request.request_id] = state
        return state

    def _inputs(self, request: RequestLike) -> _Inputs | None:
        """What names the request's blocks beside its tokens; None when its KV is not named by
        them, and it bypasses the store entirely (counted by reason)."""
        if getattr(request, "mm_features", None):  # placeholders: the same tokens for other images
            self._stats.add("bypassed_multimodal_requests", 1)
            return None
        if getattr(request, "prompt_embeds", None) is not None:  # rows of numbers, not tokens
            self._stats.add("bypassed_prompt_embeds_requests", 1)
            return None
        salt = request.cache_salt or ""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return _Inputs(salt)
        adapter = self._adapters.identity(lora)
        if adapter is None:
            self._stats.add("bypassed_adapter_requests", 1)
            return None
        return _Inputs(salt, adapter, lora.lora_name)

    # -- vLLM: get_num_new_matched_tokens --------------------------------------------------------
    def num_new_matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        state.load = None
        state.blend = None
        if not state.ids:
            return 0, False
        state.stored = self._lookup_prefix(state.ids)
        state.next_save = state.stored
        if self._events is not None and not state.announced:
            state.announced = True
            self._events.present(state.ids, request.all_token_ids, 0, state.stored, *state.inputs.event_keys)
            if state.stored < len(state.ids):
                self._events.missing(state.ids[state.stored])
        if not self._can_load:
            return 0, False
        promised = self._promised_blocks(request, state)
        if state.stored < promised:
            now = self._clock()
            if state.wait_started is None:
                state.wait_started = now
            # Waiting on a store that does not answer only adds the wait to the recompute.
            if now - state.wait_started < self._timeout and not self._lookups.stuck:
                return None, False  # ask again: the producer's blocks are not all visible yet
            logger.warning(
                "request %s: %d of %d promised blocks visible after %.1f s%s; recomputing the rest",
                request.request_id,
                state.stored,
                promised,
                now - state.wait_started,
                " (the store is not answering)" if self._lookups.stuck else "",
            )
            self._stats.add("pd_wait_timeouts", 1)
            promised = 0
        if promised and state.wait_started is not None:
            self._stats.observe("pd_wait_seconds", self._clock() - state.wait_started)
        state.wait_started = None
        local_blocks = num_computed_tokens // self.block_size
        # Blend runs the model's layers itself, without a request's adapter: adapter requests go exact.
        if self._blend is not None and not promised and not state.inputs.adapter:
            external = self._plan_blend(request, state, num_computed_tokens)
            if external:
                return external, False
        if state.stored <= local_blocks:
            return 0, False
        # vLLM must compute at least one token: on a full hit the last token is recomputed
        # (its block is still loaded whole; the recomputed slot gets the same values).
        hit_tokens = min(state.stored * self.block_size, request.num_tokens - 1)
        external = hit_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        state.load = (local_blocks, state.stored)
        state.load_tokens = external
        return external, False

    def _plan_blend(self, request: RequestLike, state: _RequestState, num_computed_tokens: int) -> int:
        """Tokens claimed for a blended region (0: none, the request goes the usual way). The region
        ends where the last chunk's stored blocks end; before it, vLLM's own hit and the store's
        exact prefix are loaded as usual, everything else is blended by the workers."""
        assert self._blend is not None
        config = self._blend.config
        prompt = list(request.prompt_token_ids or [])
        chunks = self._chunks(request, prompt, state)
        if not chunks or len(chunks) > config.max_chunks:
            return 0
        exact = max(num_computed_tokens, min(state.stored * self.block_size, request.num_tokens - 1))
        hasher = self._hasher(state.inputs)
        found: list[tuple[int, list[bytes]]] = []
        end = 0
        for start, stop in chunks:
            if stop - start < self.block_size or stop <= exact:
                continue  # no full block, or exact already
            keys = store_keys(hasher.block_ids(prompt[start:stop]), 0, self._tp_size)
            stored = self._lookup_prefix(keys)
            if stored:
                found.append((start, keys[:stored]))
                end = start + stored * self.block_size
        last = request.num_tokens - 1  # vLLM computes at least one token
        end = min(end, last)
        if end <= exact:
            return 0  # no chunk gives anything past the exact prefix
        if config.selection == "attention" and last - exact <= config.max_blend_tokens:
            end = last  # the question is blended too: it picks what to recompute (past the limit the
            # region ends at the chunks, and the worker, finding no question, selects by deviation)
        if end - exact > config.max_blend_tokens:
            return 0
        local_blocks = num_computed_tokens // self.block_size
        if state.stored > local_blocks:
            state.load = (local_blocks, state.stored)
            state.load_tokens = exact - num_computed_tokens
        missed = sum(1 for start, stop in chunks if stop - start >= self.block_size and stop > exact) - len(found)
        state.blend = _BlendPlan(end, exact, found, missed)
        return end - num_computed_tokens

    def _chunks(self, request: RequestLike, prompt: list[int], state: _RequestState) -> list[tuple[int, int]]:
        """The client's chunk boundaries when it gave them, else the prompt cut at the separators. A
        malformed list is refused once (logged, counted) and the request prefilled without Blend."""
        assert self._blend is not None
        given = (request.kv_transfer_params or {}).get(PARAM_CHUNKS)
        if given is None:
            return split_chunks(prompt, self._blend.separator)
        try:
            return explicit_chunks(given, len(prompt), self._blend.config.max_chunks)
        except ValueError as exc:
            if not state.chunks_refused:
                state.chunks_refused = True
                self._stats.add("blend_chunk_lists_refused", 1)
                logger.warning("request %s: %s; prefilled without Blend", request.request_id, exc)
            return []

    def _lookup_prefix(self, ids: list[bytes]) -> int:
        """Leading blocks of ``ids`` in the store, asked within what is left of the step's deadline
        (0, a miss, when nothing is left)."""
        now = time.monotonic()
        if self._step_deadline is None:
            self._step_deadline = now + self._lookups.timeout_s
        remaining = self._step_deadline - now
        if remaining <= 0:
            self._stats.add("lookup_deadline_skips", 1)
            return 0
        timeouts = self._lookups.timeouts
        stored = self._lookups.call(lambda: self._every_share(ids), 0, remaining)
        self._stats.add("lookup_timeouts", self._lookups.timeouts - timeouts)
        return stored

    def _every_share(self, ids: list[bytes]) -> int:
        """Leading blocks of ``ids`` (rank 0's keys) whose every worker's share is in the store: each
        worker loads its own share, so a block one of them lacks must be recomputed by all."""
        stored = self._store.lookup_prefix(ids)
        for rank in range(1, self._tp_size):
            if not stored:
                break
            stored = self._store.lookup_prefix(rank_keys(ids[:stored], rank, self._tp_size))
        return stored

    def _promised_blocks(self, request: RequestLike, state: _RequestState) -> int:
        params = request.kv_transfer_params or {}
        promised = params.get(PARAM_BLOCKS)
        if not isinstance(promised, int) or promised <= 0:
            return 0
        return min(promised, len(state.ids))

    # -- vLLM: update_state_after_alloc ----------------------------------------------------------
    def after_alloc(self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int) -> None:
        state = self._state(request)
        state.blocks = list(block_ids)
        if num_external_tokens == 0:
            state.load = None
            state.blend = None

    def requests(self) -> dict[str, Any]:
        """vLLM's requests this side follows, by id."""
        return {req_id: state.request for req_id, state in self._requests.items()}

    # -- vLLM: build_connector_meta --------------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> UCMConnectorMetadata:
        self._step_deadline = None  # vLLM builds the metadata once per step, after all its lookups
        meta = UCMConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.blocks = list(new.block_ids[0])
            self._plan(meta, new.req_id, state, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.blocks = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.blocks.extend(new_blocks[0])
            self._plan(meta, req_id, state, cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def _plan(self, meta: UCMConnectorMetadata, req_id: str, state: _RequestState, computed_after: int) -> None:
        if state.load is not None:
            start, end = state.load
            meta.loads.append(BlockTransfer(req_id, state.ids[start:end], state.blocks[start:end]))
            self._stats.add("external_hit_tokens", state.load_tokens)
            state.loaded_tokens += state.load_tokens
            state.load = None
        if state.blend is not None:
            plan, state.blend = state.blend, None
            n_blocks = -(-plan.end // self.block_size)
            tokens = list(state.request.all_token_ids[: plan.end])
            blocks = state.blocks[:n_blocks]
            first = plan.computed // self.block_size
            meta.blends.append(BlendTransfer(req_id, tokens, plan.computed, blocks, first, plan.chunks))
            self._name_blended(state, first)
            self._stats.add("blend_chunks_hit", len(plan.chunks))
            self._stats.add("blend_chunks_missed", plan.missed)
        if not self._can_save:
            return
        full = min(min(computed_after, state.num_prompt_tokens) // self.block_size, len(state.ids))
        if computed_after > state.num_prompt_tokens and self._decode_save_blocks and state.ids:
            full = self._decoded_blocks(state, computed_after)
        if full > state.next_save:
            lo = state.next_save
            # A PD prefill's decode waits for these: the prefill answers once they are written.
            pd = bool((state.request.kv_transfer_params or {}).get("do_remote_decode"))
            meta.saves.append(BlockTransfer(req_id, state.ids[lo:full], state.blocks[lo:full], wait=pd))
            state.next_save = full
            if self._events is not None and state.blend_from is None:  # blended blocks match no prompt
                self._events.present(state.ids, state.request.all_token_ids, lo, full, *state.inputs.event_keys)

    def _name_blended(self, state: _RequestState, first: int) -> None:
        """From block ``first`` on the request's KV is blended, not exact: its blocks (and the
        decoded ones chained after them) are saved under ids of this blend, which no exact prompt
        has, so only a consumer told of the blend (PARAM_BLEND) loads them."""
        assert self._blend is not None
        prompt = list(state.request.prompt_token_ids or [])
        fingerprint = self._blend.fingerprint
        blended = self._hasher(state.inputs, fingerprint).block_ids(prompt)
        state.hashes = state.hashes[:first] + blended[first:]
        state.ids = state.ids[:first] + store_keys(blended[first:], 0, self._tp_size)
        state.blend_from = first

    def _decoded_blocks(self, state: _RequestState, computed_after: int) -> int:
        """Full blocks so far, blocks filled while decoding included (up to ``decode_save_blocks``
        of them): the next turn of a chat starts with them. Their ids are hashed as they fill."""
        prompt_blocks = state.num_prompt_tokens // self.block_size
        tokens = state.request.all_token_ids
        full = min(computed_after, len(tokens)) // self.block_size
        full = min(full, prompt_blocks + self._decode_save_blocks)
        if full > len(state.hashes):
            hasher = self._hasher(state.inputs)
            known = len(state.hashes)
            state.hashes = hasher.extend(list(tokens[: full * self.block_size]), state.hashes)
            state.ids += store_keys(state.hashes[known:], 0, self._tp_size)
        return full

    # -- vLLM: request_finished ------------------------------------------------------------------
    def finished(self, request: RequestLike) -> dict[str, Any] | None:
        state = self._requests.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        if state is not None and params.get("do_remote_prefill"):
            return {PARAM_LOADED: state.loaded_tokens}  # a PD consumer says what the store gave it
        if state is None or not self._can_save or not params.get("do_remote_decode"):
            return None
        # A consumer given these waits until this many leading blocks are visible in the store.
        prompt_blocks = state.num_prompt_tokens // self.block_size
        promised = 0 if self._saves_failing else min(state.next_save, prompt_blocks)
        answer: dict[str, Any] = {"do_remote_prefill": True, PARAM_BLOCKS: promised}
        if state.blend_from is not None and self._blend is not None:
            answer[PARAM_BLEND] = [self._blend.fingerprint, state.blend_from]
        return answer

    # -- vLLM: take_events -----------------------------------------------------------------------
    def take_events(self) -> list[Any]:
        return self._events.take() if self._events is not None else []

    # -- vLLM: update_connector_output -----------------------------------------------------------
    def loads_failed(self, invalid_block_ids: set[int]) -> None:
        """vLLM computes again, from the first block that failed to load, each request holding one:
        what it computes is saved again from there (the workers dropped that step's saves; a block
        that failed to load is missing from the store, or was removed from it as corrupt)."""
        for state in self._requests.values():
            bad = next((k for k, b in enumerate(state.blocks) if b in invalid_block_ids), None)
            if bad is not None:
                state.next_save = min(state.next_save, bad)

    def worker_stats(self, data: Mapping[str, Any]) -> None:
        """What the workers' saves came to. While they fail (a full or read-only store) or do not
        land within pd_save_wait_s (a store whose writes hang), a PD consumer is promised no blocks:
        it computes at once instead of waiting pd_wait_timeout_s for blocks that will not land. The
        first save to succeed again ends that. (The step whose wait timed out has already promised
        its blocks: vLLM finishes requests before it reads the step's connector output.)"""
        if data.get("save_failed_blocks") or data.get("pd_save_wait_timeouts"):
            if not self._saves_failing:
                logger.warning("saves to the store are failing; PD consumers will compute prompts themselves")
            self._saves_failing = True
        elif data.get("saved_blocks") and self._saves_failing:
            logger.warning("saves to the store succeed again")
            self._saves_failing = False


def _blended_params(request: RequestLike) -> tuple[str, int] | None:
    """PARAM_BLEND from a producer, if well formed (anything else is ignored: the prompt's exact
    blocks are looked up as usual)."""
    value = (request.kv_transfer_params or {}).get(PARAM_BLEND)
    if value is None:
        return None
    ok = (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and 0 < len(value[0]) <= 64
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
        and value[1] >= 0
    )
    if not ok:
        logger.warning("request %s: ignoring malformed %s %r", request.request_id, PARAM_BLEND, value)
        return None
    return value[0], value[1]
