"""Blend's prefill of a prompt's reused region, computed with the served model's own modules.

A prompt ``[prefix][chunk A][chunk B]...[question]`` whose chunks' KV was cached elsewhere (each
computed from position 0, alone) is blended over its region ``[0, M)`` — everything up to the end
of the last cached chunk, or with the ``attention`` selection the whole prompt but its last token —
through a Llama-shaped model's layers:

- tokens ``[0, computed)`` are exact already (vLLM's prefix cache or an exact store load): their
  KV is read, never recomputed;
- every other token of the region starts from its cached KV when a chunk gave it one (keys
  re-rotated to the token's new position, exact for RoPE), or from nothing (separators, the
  partial block at a chunk's end, a chunk the store did not have, and each chunk's first
  ``recompute_chunk_start`` tokens, which computed alone were the prompt's attention sink: always
  recomputed);
- layers up to ``check_layer`` run for every token (layer 0's K and V depend only on the token
  and its position, so they equal the cache's); there the ``ratio`` share of reused tokens to
  recompute is chosen — ``deviation`` (CacheBlend's): those whose fresh KV at ``check_layer``
  deviates most from their cached KV; ``attention``: those the question attends to most in the
  later layers, found by a first pass of the tokens without a cached KV over the others' cached KV
  (:func:`_attended_rows`); from there on only the recomputed tokens and those without a cached KV
  run, attending over the cached KV of the others.

The result is each layer's K and V for ``[computed, M)``, which the connector writes into the
request's paged cache; vLLM then prefills the rest exactly, over it. At ``ratio`` 1 every token
is recomputed through every layer: a plain prefill of the region.

:class:`Blender` is the worker's part: it reads the chunks' blocks from the store and the exact
prefix from the paged cache, blends, and writes the result with vLLM's own cache writer. It runs
in ``start_load_kv``, before the step's forward pass (vLLM's CPU backend only, for now: the cache
layout is read the way the sparse backend reads it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

import torch
import torch.nn.functional as F
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from ucm.integration.vllm.attention import KernelShape, attend, learn_layout
from ucm.integration.vllm.config import BlendConfig, Selection
from ucm.integration.vllm.layout import KVLayout
from ucm.integration.vllm.metadata import BlendTransfer, rank_keys
from ucm.integration.vllm.staging import StagingPool
from ucm.integration.vllm.stats import StatsRecorder
from ucm.sparse.blend import select_recompute, share, top_share
from ucm.store import Store, Task

logger = logging.getLogger(__name__)

# Queries attended at once: bounds the score matrix to QUERY_ROWS x region x heads floats.
QUERY_ROWS = 512


@dataclass
class Region:
    """One request's region to blend; per-layer tensors are ``(M, kv_heads, head_dim)``."""

    tokens: torch.Tensor  # (M,) token ids of [0, M)
    computed: int  # leading tokens whose KV is exact and in place
    reused: torch.Tensor  # (M,) bool: tokens in [computed, M) with a cached KV
    keys: list[torch.Tensor]  # per layer: exact for [0, computed), cached (re-rotated) where reused
    values: list[torch.Tensor]


@dataclass
class Blended:
    keys: list[torch.Tensor]  # per layer, (M - computed, kv_heads, head_dim): what to write
    values: list[torch.Tensor]
    recomputed: torch.Tensor  # positions recomputed past check_layer (every non-reused one among them)


def rerotate(rotary_emb: torch.nn.Module, keys: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
    """Keys RoPE'd at positions ``p`` -> the same keys RoPE'd at ``p + shift``: rotating by the
    shift composes with the rotation already applied (angles linear in position), with the model's
    own rotary embedding. ``keys``: (T, kv_heads, head_dim); ``shift``: one for all, or (T,)."""
    if isinstance(shift, int):
        if shift == 0:
            return keys
        shift = torch.full((keys.shape[0],), shift, dtype=torch.long)
    flat = keys.reshape(keys.shape[0], -1)
    rotated, _ = rotary_emb.forward_native(shift.to(keys.device), flat.clone())
    return rotated.view_as(keys)


# (layer, queries (R, heads, D), the region's keys and values (M, kv_heads, D), the queries'
# positions (R,) ascending, scale) -> (R, heads, D): causal attention of each query over the keys at
# or before its position.
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass
class _LayerOut:
    hidden: torch.Tensor
    residual: torch.Tensor
    q: torch.Tensor  # (R, heads, D): the running rows' queries
    k: torch.Tensor  # (R, kv_heads, D): their fresh keys and values
    v: torch.Tensor
    keys: torch.Tensor  # (M, kv_heads, D): the region's, the running rows' fresh
    values: torch.Tensor


def _forward(
    layer: torch.nn.Module,
    index: int,
    rows: torch.Tensor,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    region: Region,
    attend: Attention,
) -> _LayerOut:
    """One decoder layer over the running ``rows``, which attend over the region's KV with their own
    fresh K and V in place of what the region holds for them."""
    if residual is None:
        residual = hidden
        x = layer.input_layernorm(hidden)
    else:
        x, residual = layer.input_layernorm(hidden, residual)
    attn = layer.self_attn
    qkv, _ = attn.qkv_proj(x)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = attn.rotary_emb(rows, q, k)
    q = q.view(-1, attn.num_heads, attn.head_dim)
    k = k.view(-1, attn.num_kv_heads, attn.head_dim)
    v = v.view(-1, attn.num_kv_heads, attn.head_dim)
    keys = region.keys[index].clone()
    values = region.values[index].clone()
    keys[rows] = k
    values[rows] = v
    out = attend(index, q, keys, values, rows, attn.scaling)
    out, _ = attn.o_proj(out.reshape(out.shape[0], -1))
    hidden, residual = layer.post_attention_layernorm(out, residual)
    return _LayerOut(layer.mlp(hidden), residual, q, k, v, keys, values)


@torch.inference_mode()
def blend_region(
    model: torch.nn.Module,
    region: Region,
    ratio: float,
    check_layer: int = 1,
    attend: Attention | None = None,
    selection: Selection = "deviation",
) -> Blended:
    """Compute ``region`` through ``model`` (vLLM's LlamaForCausalLM, or any model with the same
    modules) as the module docstring says. ``attend``: plain PyTorch attention unless given (the
    served path passes vLLM's kernel over the paged cache, :class:`PagedAttention`). ``selection``:
    ``deviation`` (CacheBlend's) or ``attention`` (see :func:`_attended_rows`)."""
    attend = attend or sdpa_attention
    inner = model.model
    layers = inner.layers
    m = region.tokens.shape[0]
    c = region.computed
    if not 0 <= c < m:
        raise ValueError(f"blend: computed={c} must be in [0, {m}) (at least one token to blend)")
    if selection not in get_args(Selection):
        raise ValueError(f"blend: selection={selection!r}: one of {get_args(Selection)}")
    device = region.keys[0].device
    rows = torch.arange(c, m, device=device)  # positions of the tokens still running
    hidden = inner.embed_input_ids(region.tokens[c:])
    residual: torch.Tensor | None = None
    keys_out: list[torch.Tensor] = []
    values_out: list[torch.Tensor] = []
    check = min(check_layer, len(layers) - 1)
    for index, layer in enumerate(layers):
        out = _forward(layer, index, rows, hidden, residual, region, attend)
        hidden, residual = out.hidden, out.residual
        keys_out.append(out.keys[c:])
        values_out.append(out.values[c:])
        if index != check:
            continue
        keep = None
        if selection == "attention":
            keep = _attended_rows(layers, check, rows, hidden, residual, region, attend, ratio)
        if keep is None:
            cached_k, cached_v = region.keys[index][rows], region.values[index][rows]
            keep = _recompute_rows(region.reused[rows], cached_k, cached_v, out.k, out.v, ratio)
        rows, hidden, residual = rows[keep], hidden[keep], residual[keep]
    return Blended(keys_out, values_out, rows)


# The question's queries whose attention ranks reused tokens (its last ones, nearest the answer): bounds
# the score matrix to QUESTION_ROWS x heads x region floats per layer.
QUESTION_ROWS = 128


def _attended_rows(
    layers: torch.nn.ModuleList,
    check: int,
    rows: torch.Tensor,
    hidden: torch.Tensor,
    residual: torch.Tensor,
    region: Region,
    attend: Attention,
    ratio: float,
) -> torch.Tensor | None:
    """Indices (into the running rows) that run past the check layer, chosen by the question: the
    tokens without a cached KV run ahead through the remaining layers over the others' cached KV
    (a first pass, its KV discarded), and the ``ratio`` share of reused tokens the question's queries
    attend to most there (summed over layers, heads and queries) joins them. CacheBlend's deviation
    at one early layer cannot see what matters far from a chunk: which of the stale tokens the
    answer reads. None when the region holds no question (no token after the last reused one)."""
    reused = region.reused[rows]
    where = reused.nonzero().squeeze(1)
    if where.numel() == 0:
        return torch.arange(rows.numel(), device=rows.device)
    ahead = (~reused).nonzero().squeeze(1)
    question = (rows[ahead] > rows[where[-1]]).nonzero().squeeze(1)[-QUESTION_ROWS:]
    if question.numel() == 0:
        return None
    n = share(where.numel(), ratio)
    if n == 0 or check + 1 == len(layers):
        return _with_picked(reused, where[:n])  # no choice to make, or no later layer to make it in
    run, h, r = rows[ahead], hidden[ahead], residual[ahead]
    mass = torch.zeros(region.tokens.shape[0], device=rows.device)
    for index in range(check + 1, len(layers)):
        out = _forward(layers[index], index, run, h, r, region, attend)
        h, r = out.hidden, out.residual
        mass += _attention_mass(out.q[question], out.keys, run[question], layers[index].self_attn.scaling)
    return _with_picked(reused, where[top_share(mass[rows[where]], ratio)])


def _attention_mass(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """(M,) attention the queries ``q`` (R, heads, D) at ``positions`` pay each of ``keys``
    (M, kv_heads, D), causally, summed over queries and heads."""
    kv_heads, dim = keys.shape[1], keys.shape[2]
    group = q.shape[1] // kv_heads
    grouped = q.float().view(-1, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
    scores = torch.bmm(grouped, keys.float().permute(1, 2, 0)) * scale  # (kv_heads, R * group, M)
    span = torch.arange(keys.shape[0], device=keys.device)
    scores.masked_fill_(span[None, None, :] > positions.repeat_interleave(group)[None, :, None], float("-inf"))
    return scores.softmax(-1).sum((0, 1))


def _recompute_rows(
    reused: torch.Tensor,
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    ratio: float,
) -> torch.Tensor:
    """Indices (into the running rows) that run past the check layer: every token without a cached
    KV, and the ``ratio`` share of the reused ones whose KV deviates most from a fresh computation."""
    where = reused.nonzero().squeeze(1)
    cached = torch.stack([cached_k[where], cached_v[where]], dim=1)
    fresh = torch.stack([fresh_k[where], fresh_v[where]], dim=1)
    return _with_picked(reused, where[select_recompute(cached, fresh, ratio)])


def _with_picked(reused: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """Indices of the rows without a cached KV and of the ``picked`` reused ones, ascending."""
    keep = ~reused
    keep[picked] = True
    return keep.nonzero().squeeze(1)


def sdpa_attention(
    layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """:data:`Attention` with PyTorch's scaled_dot_product_attention and an explicit mask (any
    device; on the CPU ~4x slower than vLLM's kernel, which skips what the mask hides)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # (heads, M, D)
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    span = torch.arange(keys.shape[0], device=keys.device)
    out = torch.empty_like(q)
    for lo in range(0, q.shape[0], QUERY_ROWS):
        hi = min(lo + QUERY_ROWS, q.shape[0])
        mask = span[None, :] <= positions[lo:hi, None]
        part = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[lo:hi] = part.transpose(0, 1)
    return out


class Blender:
    """Blends requests' regions into the paged cache (one worker: its heads of every layer)."""

    def __init__(
        self,
        config: BlendConfig,
        layout: KVLayout,
        store: Store,
        *,
        rank: int,
        tp_size: int,
        stats: StatsRecorder,
        load_timeout_s: float | None,
        model: Callable[[], torch.nn.Module | None],
        staging: StagingPool,
    ) -> None:
        slot = layout.slots[0]
        if layout.device.type != "cpu" or len(slot.block_shape) != 3:
            raise ValueError("blend: runs on vLLM's CPU attention backend only (for now)")
        if any((s.block_shape, s.dtype) != (slot.block_shape, slot.dtype) for s in layout.slots):
            raise ValueError("blend: every attention layer must have the same KV shape and dtype")
        # vLLM's CPU cache: (blocks, kv_heads, block_size, 2 * head_dim), used as
        # (blocks, kv_heads, 2 * block_size, head_dim): a head's keys, then its values
        self.kv_heads, self.block_size, twice_dim = slot.block_shape
        self.head_dim = twice_dim // 2
        self.isa = _get_attn_isa(slot.dtype, self.block_size, self.head_dim)
        self.key_order, self.value_order = (
            p.long() for p in learn_layout(slot.dtype, self.isa, self.block_size, self.head_dim)
        )
        self.config = config
        self.layout = layout
        self._store = store
        self._rank = rank
        self._tp_size = tp_size
        self._stats = stats
        self._timeout = load_timeout_s
        self._model = model
        self._staging = staging
        self._memory: torch.Tensor | None = None  # (2, layers, tokens, kv_heads, head_dim): regions' KV

    def run(self, transfer: BlendTransfer) -> bool:
        """Blend one region into its blocks; False: not blended (vLLM must compute them)."""
        model = self._model()
        if model is None:
            logger.error(
                "blend: the engine's model is not UCM's Blend class; start it with --hf-overrides "
                '\'{"architectures": ["UCMBlendLlamaForCausalLM"]}\' (request %s prefilled as usual)',
                transfer.req_id,
            )
            return False
        if len(model.model.layers) != len(self.layout.slots):
            logger.error(
                "blend: %d model layers but %d KV cache layers", len(model.model.layers), len(self.layout.slots)
            )
            return False
        started = time.perf_counter()
        chunks = self._staging.take(sum(len(keys) for _, keys in transfer.chunks))
        region, read = self._region(transfer, model, chunks)
        self._staging.give_when_done(chunks, [read])  # a read past its deadline keeps it until it ends
        attention = PagedAttention(self, transfer.block_ids, region.computed, region.tokens.shape[0])
        config = self.config
        out = blend_region(model, region, config.recompute_ratio, config.check_layer, attention, config.selection)
        recomputed = out.recomputed.numel()
        self._stats.add("blend_recomputed_tokens", recomputed)
        self._stats.add("blend_reused_tokens", region.tokens.shape[0] - region.computed - recomputed)
        self._stats.observe("blend_seconds", time.perf_counter() - started)
        return True

    def _region(self, transfer: BlendTransfer, model: torch.nn.Module, chunks: torch.Tensor) -> tuple[Region, Task]:
        """The region to blend, its chunks read into ``chunks``; and that read. Each layer's chunk
        keys are unpacked and re-rotated in one call for all chunks."""
        end, computed, bs = len(transfer.tokens), transfer.computed, self.block_size
        if self._memory is None or self._memory.shape[2] < end:
            # Kept across blends, the largest region's: fresh memory page-faults on first touch
            # (a 2,800-token region of SmolLM2 in float32 is 130 MB).
            shape = (2, len(self.layout.slots), end, self.kv_heads, self.head_dim)
            self._memory = torch.empty(shape, dtype=self.layout.slots[0].dtype)
        keys, values = list(self._memory[0, :, :end]), list(self._memory[1, :, :end])
        filled = torch.zeros(end, dtype=torch.bool)
        filled[:computed] = True
        if computed:
            exact = transfer.block_ids[: -(-computed // bs)]
            for layer, (k_out, v_out) in enumerate(zip(keys, values, strict=True)):
                k, v = self._unpack(self.layout.blocks_first(layer)[exact])
                k_out[:computed], v_out[:computed] = k[:computed], v[:computed]
        read, ok = self._load_chunks(transfer, chunks)
        # Per cached token: its row among the chunks' unpacked tokens, its place in the region, and
        # the chunk's start (its keys' rotation shift).
        source, target, shift = [], [], []
        at = 0
        for start, chunk_keys in transfer.chunks:
            for first, last in _spans(ok[at : at + len(chunk_keys)]):
                lo, hi = max(start + first * bs, computed), min(start + last * bs, end)
                if lo < hi:
                    source.append(torch.arange(lo, hi) + (at * bs - start))
                    target.append(torch.arange(lo, hi))
                    shift.append(torch.full((hi - lo,), start))
            at += len(chunk_keys)
        if source:
            src, dst, rot = torch.cat(source), torch.cat(target), torch.cat(shift)
            filled[dst] = True
            for layer, (k_out, v_out) in enumerate(zip(keys, values, strict=True)):
                k, v = self._unpack(self.layout.payload_layer(chunks[:at], layer))
                k_out[dst] = rerotate(model.model.layers[layer].self_attn.rotary_emb, k[src], rot)
                v_out[dst] = v[src]
        empty = ~filled
        for k_out, v_out in zip(keys, values, strict=True):  # reused memory: no stale KV where none was put
            k_out[empty] = 0
            v_out[empty] = 0
        reused = filled.clone()
        reused[:computed] = False
        for start, _ in transfer.chunks:
            if start:  # computed alone, a chunk's first tokens are an attention sink: not kept mid-prompt
                reused[start : start + self.config.recompute_chunk_start] = False
        return Region(torch.tensor(transfer.tokens), computed, reused, keys, values), read

    def _load_chunks(self, transfer: BlendTransfer, buffer: torch.Tensor) -> tuple[Task, list[bool]]:
        """The read of the chunks' stored blocks into ``buffer``'s rows, one after another; and which
        of them loaded (a block that did not is computed instead)."""
        keys = [k for _, chunk_keys in transfer.chunks for k in chunk_keys]
        staging = buffer[: len(keys)]
        task = self._store.load(rank_keys(keys, self._rank, self._tp_size), list(staging.numpy()))
        try:
            ok = task.wait(self._timeout)
        except TimeoutError:
            logger.warning(
                "blend: request %s: chunks not loaded in %.1f s; computing them", transfer.req_id, self._timeout
            )
            ok = [False] * len(keys)
        self._stats.add("loaded_blocks", sum(ok))
        self._stats.add("load_failed_blocks", len(ok) - sum(ok))
        return task, ok

    def caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s key and value caches, as vLLM's CPU backend passes them to its ops."""
        return self._halves(self.layout.blocks_first(layer)).chunk(2, dim=2)

    def _halves(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.view(blocks.shape[0], self.kv_heads, 2 * self.block_size, self.head_dim)

    def _unpack(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks as the CPU cache holds them (``(n, kv_heads, block_size, 2 * head_dim)``) -> their
        tokens' keys and values, ``(n * block_size, kv_heads, head_dim)`` each."""
        n, bs, d = blocks.shape[0], self.block_size, self.head_dim
        blocks = self._halves(blocks)
        out = []
        for half, order in ((blocks[:, :, :bs], self.key_order), (blocks[:, :, bs:], self.value_order)):
            logical = half.reshape(n, self.kv_heads, bs * d)[..., order]
            out.append(logical.view(n, self.kv_heads, bs, d).transpose(1, 2).reshape(n * bs, self.kv_heads, d))
        return out[0], out[1]


class PagedAttention:
    """:data:`Attention` for one request's region with vLLM's CPU kernel over its paged cache. Each
    layer's region KV is written into the cache first (the blend's output: what vLLM's prefill of
    the question then reads), then the running queries attend: one kernel row per contiguous run of
    positions, since the kernel aligns a row's queries with the end of its sequence."""

    def __init__(self, blender: Blender, block_ids: list[int], computed: int, end: int) -> None:
        self.blender = blender
        bs = blender.block_size
        blocks = torch.tensor(block_ids, dtype=torch.long)
        positions = torch.arange(computed, end)
        self.slots = blocks[positions // bs] * bs + positions % bs
        self.computed = computed
        self.table = blocks.to(torch.int32)[None, :]
        self.shape: KernelShape | None = None

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        b = self.blender
        key_cache, value_cache = b.caches(layer)
        c = self.computed
        ops.cpu_attn_reshape_and_cache(keys[c:], values[c:], key_cache, value_cache, self.slots, b.isa)
        if self.shape is None:
            self.shape = KernelShape(q.shape[1], keys.shape[1], q.shape[2], q.dtype, b.isa, "auto")
        breaks = (positions[1:] != positions[:-1] + 1).nonzero().squeeze(1) + 1
        bounds = torch.cat([positions.new_zeros(1), breaks, positions.new_tensor([positions.numel()])])
        starts = bounds.to(torch.int32)
        seq_lens = (positions[bounds[1:] - 1] + 1).to(torch.int32)
        runs = seq_lens.numel()
        q = q.contiguous()
        out = torch.empty_like(q)
        attend(
            q,
            key_cache,
            value_cache,
            out,
            starts,
            seq_lens,
            self.table.expand(runs, -1).contiguous(),
            self.shape.schedule(seq_lens, starts, q.shape[1], keys.shape[1]),
            scale=scale,
        )
        return out


def _spans(ok: list[bool]) -> list[tuple[int, int]]:
    """``[first, last)`` of each run of True in ``ok``."""
    spans = []
    first = None
    for i, good in enumerate([*ok, False]):
        if good and first is None:
            first = i
        elif not good and first is not None:
            spans.append((first, i))
            first = None
    return spans
