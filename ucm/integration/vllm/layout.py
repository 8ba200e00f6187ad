"""Paged KV tensors <-> one contiguous payload per block.

vLLM hands the connector one tensor per attention layer. vLLM 0.32 gives every backend's cache in
one logical order, ``[blocks, kv_heads, block_size, content]`` (CPU: ``content`` is a head's key
and value; the strides say where the backend keeps what), and earlier versions other orders (CUDA
FlashAttention: ``[2, blocks, block_size, kv_heads, head_dim]``): whatever the order, one dimension
indexes blocks. A block's bytes in one layer are the tensor with that dimension
removed, in logical order; a block's payload is those bytes for every layer, layer after layer.
Deriving this from shapes rather than backend names keeps the connector working across backends,
and makes the payload depend only on the logical layout.

Gather and scatter go through :mod:`ucm.native`: the native layer's threaded copy when it is
installed (for host memory), otherwise one indexed torch copy per layer for a whole batch of blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ucm import native


@dataclass(frozen=True)
class LayerSlot:
    name: str
    blocks_dim: int
    block_shape: tuple[int, ...]  # the layer's shape without the blocks dimension
    dtype: torch.dtype
    offset: int  # byte offset of this layer in a block's payload
    nbytes: int  # bytes of one block in this layer


class KVLayout:
    """Where each block of each layer lives, and how many bytes a block's payload has."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("kv_caches: no attention layers were registered")
        self._tensors: dict[str, torch.Tensor] = {}
        self._layers: dict[str, tuple[torch.Tensor, int]] = {}
        slots = []
        offset = 0
        for name, tensor in kv_caches.items():
            dim = blocks_dim(tensor, num_blocks, name)
            shape = tuple(s for d, s in enumerate(tensor.shape) if d != dim)
            nbytes = tensor.element_size() * _prod(shape)
            slots.append(LayerSlot(name, dim, shape, tensor.dtype, offset, nbytes))
            self._tensors[name] = tensor.movedim(dim, 0)  # a view: blocks first
            self._layers[name] = (tensor, dim)
            offset += nbytes
        self.slots: tuple[LayerSlot, ...] = tuple(slots)
        self.block_bytes = offset
        self.num_blocks = num_blocks
        self.device = next(iter(kv_caches.values())).device
        self._index = {s.name: i for i, s in enumerate(self.slots)}
        self._layer_copiers = [native.Copier([self._layers[s.name]]) for s in self.slots]
        self._block_copier = native.Copier([self._layers[s.name] for s in self.slots])

    def layer_index(self, name: str) -> int:
        return self._index[name]

    def blocks_first(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s cache viewed with blocks as the first dimension."""
        return self._tensors[self.slots[layer].name]

    def payload_layer(self, staging: torch.Tensor, layer: int) -> torch.Tensor:
        """Rows of ``staging`` (payloads) as layer ``layer``'s blocks: ``(rows, *block_shape)``."""
        slot = self.slots[layer]
        return self._part(staging, slot).view(slot.dtype).reshape(staging.shape[0], *slot.block_shape)

    @property
    def in_place(self) -> bool:
        """True when every block of every layer is one contiguous range of host memory: a store can
        then read a payload straight into the paged cache (one segment per layer), with no staging."""
        return self.device.type == "cpu" and all(t[0].is_contiguous() for t in self._tensors.values())

    def block_segments(self, block: int) -> list[memoryview]:
        """One block's memory in every layer, in payload order (requires :attr:`in_place`)."""
        return [memoryview(t[block].view(torch.uint8).numpy()) for t in self._tensors.values()]

    def new_staging(self, n: int) -> torch.Tensor:
        """Host memory for ``n`` payloads (pinned when the KV lives on a GPU, for async copies)."""
        return torch.empty((n, self.block_bytes), dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def _part(self, staging: torch.Tensor, slot: LayerSlot) -> torch.Tensor:
        """The bytes of each staging row that hold ``slot``'s layer."""
        return staging[:, slot.offset : slot.offset + slot.nbytes]

    def gather_layer(self, layer: int, block_ids: Sequence[int], staging: torch.Tensor) -> None:
        """Copy one layer of ``block_ids`` into rows of ``staging`` (row i <- block_ids[i])."""
        self._layer_copiers[layer].gather(block_ids, self._part(staging, self.slots[layer]))

    def scatter_layer(self, layer: int, block_ids: Sequence[int], staging: torch.Tensor) -> None:
        """Copy rows of ``staging`` into one layer of the paged cache (block_ids[i] <- row i)."""
        self._layer_copiers[layer].scatter(block_ids, self._part(staging, self.slots[layer]))

    def scatter_block(self, block: int, payload: memoryview) -> None:
        """Copy one block's payload into every layer of the paged cache."""
        self._block_copier.scatter([block], torch.frombuffer(payload, dtype=torch.uint8).view(1, -1))

    def head_share(self, kv_heads: int, shares: int, share: int) -> KVLayout:
        """The same blocks restricted to share ``share`` of ``shares`` equal ranges of the ``kv_heads``
        KV heads each layer holds: what one tensor-parallel rank of a larger TP holds of a block."""
        if kv_heads % shares:
            raise ValueError(f"{kv_heads} KV heads do not split into {shares} equal shares")
        each = kv_heads // shares
        caches = {}
        for slot in self.slots:
            # vLLM 0.32 hands every layer in its logical order, [blocks, heads, block_size, content]
            # (strides per backend): the heads follow the blocks.
            tensor, dim = self._layers[slot.name]
            if tensor.dim() <= dim + 1 or tensor.shape[dim + 1] != kv_heads:
                raise ValueError(
                    f"{slot.name}: a cache of shape {tuple(tensor.shape)} does not hold {kv_heads} KV heads right "
                    "after its blocks dimension, as vLLM's [blocks, heads, block_size, content] does"
                )
            caches[slot.name] = tensor.narrow(dim + 1, share * each, each)
        return KVLayout(caches, self.num_blocks)

    def gather(self, block_ids: Sequence[int], staging: torch.Tensor) -> None:
        for layer in range(len(self.slots)):
            self.gather_layer(layer, block_ids, staging)


def blocks_dim(tensor: torch.Tensor, num_blocks: int, name: str = "kv cache") -> int:
    """The dimension that indexes blocks: sized ``num_blocks``; if several are, the outermost in memory."""
    candidates = [d for d, s in enumerate(tensor.shape) if s == num_blocks]
    if not candidates:
        raise ValueError(f"{name}: no dimension of shape {tuple(tensor.shape)} has num_blocks={num_blocks}")
    return max(candidates, key=lambda d: (tensor.stride(d), -d))


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
