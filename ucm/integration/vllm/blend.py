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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ucm.sparse.blend import select_recompute

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
