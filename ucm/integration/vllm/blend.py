"""Blend's prefill of a prompt's reused region, computed with the served model's own modules.

A prompt ``[prefix][chunk A][chunk B]...[question]`` whose chunks' KV was cached elsewhere (each
computed from position 0, alone) is blended over its region ``[0, M)`` — everything up to the end
of the last cached chunk — in one pass of a Llama-shaped model's layers:

- tokens ``[0, computed)`` are exact already (vLLM's prefix cache or an exact store load): their
  KV is read, never recomputed;
- every other token of the region starts from its cached KV when a chunk gave it one (keys
  re-rotated to the token's new position, exact for RoPE), or from nothing (separators, the
  partial block at a chunk's end, a chunk the store did not have: always recomputed);
- layers below ``check_layer`` run for every token (layer 0's K and V depend only on the token
  and its position, so they equal the cache's); at ``check_layer`` the fresh KV of every reused
  token is compared with its cached KV and the ``ratio`` share that deviates most joins the
  recomputed tokens (CacheBlend's selection); from there on only those tokens run, attending over
  the cached KV of the others.

The result is each layer's K and V for ``[computed, M)``, which the connector writes into the
request's paged cache; vLLM then prefills the question exactly, over it. At ``ratio`` 1 every
token is recomputed through every layer: a plain prefill of the region.

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

import torch
import torch.nn.functional as F

from ucm.integration.vllm.config import BlendConfig
from ucm.integration.vllm.layout import KVLayout
from ucm.integration.vllm.metadata import BlendTransfer, rank_keys
from ucm.integration.vllm.stats import StatsRecorder
from ucm.sparse.blend import select_recompute
from ucm.store import Store

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


def rerotate(rotary_emb: torch.nn.Module, keys: torch.Tensor, shift: int) -> torch.Tensor:
    """Keys RoPE'd at positions ``p`` -> the same keys RoPE'd at ``p + shift``: rotating by the
    shift composes with the rotation already applied (angles linear in position), with the model's
    own rotary embedding. ``keys``: (T, kv_heads, head_dim)."""
    if shift == 0:
        return keys
    flat = keys.reshape(keys.shape[0], -1)
    positions = torch.full((keys.shape[0],), shift, dtype=torch.long, device=keys.device)
    rotated, _ = rotary_emb.forward_native(positions, flat.clone())
    return rotated.view_as(keys)


@torch.inference_mode()
def blend_region(model: torch.nn.Module, region: Region, ratio: float, check_layer: int = 1) -> Blended:
    """Compute ``region`` through ``model`` (vLLM's LlamaForCausalLM, or any model with the same
    modules) as the module docstring says."""
    inner = model.model
    layers = inner.layers
    m = region.tokens.shape[0]
    c = region.computed
    if not 0 <= c < m:
        raise ValueError(f"blend: computed={c} must be in [0, {m}) (at least one token to blend)")
    device = region.keys[0].device
    rows = torch.arange(c, m, device=device)  # positions of the tokens still running
    hidden = inner.embed_input_ids(region.tokens[c:])
    residual: torch.Tensor | None = None
    keys_out: list[torch.Tensor] = []
    values_out: list[torch.Tensor] = []
    check = min(check_layer, len(layers) - 1)
    for index, layer in enumerate(layers):
        if residual is None:
            residual = hidden
            x = layer.input_layernorm(hidden)
        else:
            x, residual = layer.input_layernorm(hidden, residual)
        attn = layer.self_attn
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(rows, q, k)
        k = k.view(-1, attn.num_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_kv_heads, attn.head_dim)
        keys = region.keys[index].clone()
        values = region.values[index].clone()
        keep: torch.Tensor | None = None
        if index == check:
            keep = _recompute_rows(region.reused[rows], keys[rows], values[rows], k, v, ratio)
        keys[rows] = k
        values[rows] = v
        out = _attend(q.view(-1, attn.num_heads, attn.head_dim), keys, values, rows, attn.scaling)
        out, _ = attn.o_proj(out.reshape(out.shape[0], -1))
        hidden, residual = layer.post_attention_layernorm(out, residual)
        hidden = layer.mlp(hidden)
        keys_out.append(keys[c:])
        values_out.append(values[c:])
        if keep is not None:
            rows, hidden, residual = rows[keep], hidden[keep], residual[keep]
    return Blended(keys_out, values_out, rows)


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
    picked = where[select_recompute(cached, fresh, ratio)]
    keep = torch.zeros_like(reused)
    keep[picked] = True
    keep |= ~reused
    return keep.nonzero().squeeze(1)


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of queries at ``positions`` (R, heads, D) over the region's KV (M, kv_heads,
    D): a query sees the keys at or before its position."""
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
    ) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        from ucm.integration.vllm.attention import learn_layout

        slot = layout.slots[0]
        if layout.device.type != "cpu" or len(slot.block_shape) != 3:
            raise ValueError("blend: runs on vLLM's CPU attention backend only (for now)")
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

    def run(self, transfer: BlendTransfer) -> bool:
        """Blend one region into its blocks; False: nothing written (vLLM must recompute them)."""
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
        region = self._region(transfer, model)
        out = blend_region(model, region, self.config.recompute_ratio, self.config.check_layer)
        positions = torch.arange(region.computed, region.tokens.shape[0])
        blocks = torch.tensor(transfer.block_ids, dtype=torch.long)
        slots = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        from vllm import _custom_ops as ops

        for layer in range(len(self.layout.slots)):
            key_cache, value_cache = self._halves(self.layout.blocks_first(layer)).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(out.keys[layer], out.values[layer], key_cache, value_cache, slots, self.isa)
        recomputed = out.recomputed.numel()
        self._stats.add("blend_recomputed_tokens", recomputed)
        self._stats.add("blend_reused_tokens", positions.numel() - recomputed)
        self._stats.observe("blend_seconds", time.perf_counter() - started)
        return True

    def _region(self, transfer: BlendTransfer, model: torch.nn.Module) -> Region:
        end, computed, bs = len(transfer.tokens), transfer.computed, self.block_size
        dtype = self.layout.slots[0].dtype
        layers = range(len(self.layout.slots))
        keys = [torch.zeros(end, self.kv_heads, self.head_dim, dtype=dtype) for _ in layers]
        values = [torch.zeros_like(k) for k in keys]
        reused = torch.zeros(end, dtype=torch.bool)
        if computed:
            exact = transfer.block_ids[: -(-computed // bs)]
            for layer in layers:
                k, v = self._unpack(self.layout.blocks_first(layer)[exact])
                keys[layer][:computed], values[layer][:computed] = k[:computed], v[:computed]
        for start, (staging, ok) in zip((c[0] for c in transfer.chunks), self._load_chunks(transfer), strict=True):
            # the chunk's loaded blocks, and where their tokens go: past the exact prefix, before the end
            good = [i for i, loaded in enumerate(ok) if loaded]
            if not good:
                continue
            where = (start + torch.tensor(good)[:, None] * bs + torch.arange(bs)).flatten()
            take = (where >= computed) & (where < end)
            where = where[take]
            reused[where] = True
            for layer in layers:
                k, v = self._unpack(self.layout.payload_layer(staging[good], layer))
                k = rerotate(model.model.layers[layer].self_attn.rotary_emb, k, start)
                keys[layer][where] = k[take]
                values[layer][where] = v[take]
        return Region(torch.tensor(transfer.tokens), computed, reused, keys, values)

    def _load_chunks(self, transfer: BlendTransfer) -> list[tuple[torch.Tensor, list[bool]]]:
        """Each chunk's stored blocks as payload rows, and which of them loaded (a block that did
        not is computed instead)."""
        keys = [k for _, chunk_keys in transfer.chunks for k in chunk_keys]
        staging = self.layout.new_staging(len(keys))
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
        out, at = [], 0
        for _, chunk_keys in transfer.chunks:
            n = len(chunk_keys)
            out.append((staging[at : at + n], ok[at : at + n]))
            at += n
        return out

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
