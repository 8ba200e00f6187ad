"""KV block gather/scatter between paged tensors and contiguous buffers.

The native transfer layer (``runtime/native``, module ``ucm_native``) does it with threads and the
GIL released, and on GPUs with one CUDA kernel per batch; torch does it otherwise and is the
reference the native code must match byte for byte. ``ucm`` works without the extension.

A *segment* says where one tensor's bytes of block ``b`` are (see :func:`segment_of`); a block's
payload is its segments' bytes in order, and payload ``i`` goes to row ``i`` of the buffer.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

try:
    import ucm_native as _native
except ImportError:  # the extension is optional
    _native = None


def available() -> bool:
    return _native is not None


def cuda_available() -> bool:
    """The CUDA kernels are built and not turned off (``UCM_NATIVE_CUDA=0`` falls back to torch).
    Checked on an H200 byte for byte against torch's copy, for every KV layout the connector meets
    and under compute-sanitizer (tests/runtime/test_native.py, tests/connector/test_layout.py)."""
    return _native is not None and bool(_native.cuda) and os.environ.get("UCM_NATIVE_CUDA", "1") != "0"


@dataclass(frozen=True)
class Segment:
    base: int
    block_stride: int
    chunks: int
    chunk_stride: int
    chunk_bytes: int

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.base, self.block_stride, self.chunks, self.chunk_stride, self.chunk_bytes)


def segment_of(tensor: torch.Tensor, blocks_dim: int) -> Segment | None:
    """Block ``b`` of ``tensor`` (indexed by dimension ``blocks_dim``) as a segment, or None when the
    layout cannot be one: the dimensions after the block dimension must be contiguous, and those
    before it must flatten to a single stride (they become the chunks)."""
    shape, strides, es = tensor.shape, tensor.stride(), tensor.element_size()
    expected = 1
    for size, stride in zip(reversed(shape[blocks_dim + 1 :]), reversed(strides[blocks_dim + 1 :]), strict=True):
        if size != 1 and stride != expected:
            return None
        expected *= size
    outer = [(size, stride) for size, stride in zip(shape[:blocks_dim], strides[:blocks_dim], strict=True) if size != 1]
    for (_, stride), (size_next, stride_next) in itertools.pairwise(outer):
        if stride != stride_next * size_next:
            return None
    return Segment(
        base=tensor.data_ptr(),
        block_stride=strides[blocks_dim] * es,
        chunks=math.prod(s for s, _ in outer),
        chunk_stride=outer[-1][1] * es if outer else 0,
        chunk_bytes=expected * es,
    )


def payload_bytes(layers: Sequence[tuple[torch.Tensor, int]]) -> int:
    return sum(t.numel() // t.shape[d] * t.element_size() for t, d in layers)


class Copier:
    """Moves blocks of these layers to and from rows of buffers (row ``i`` <-> block ``blocks[i]`` of
    every layer, the layers' bytes in order). The layers' segments are worked out once, so a Copier
    holds their addresses: make it after the tensors are allocated, and a new one if they move. The
    connector lands a load one block at a time, and working the segments out on every call cost
    more than a 1 MiB copy (~140 µs of Python per block, holding the GIL its I/O threads share)."""

    def __init__(self, layers: Sequence[tuple[torch.Tensor, int]]) -> None:
        self.layers = list(layers)
        self.payload_bytes = payload_bytes(self.layers)
        segments = [segment_of(t, d) for t, d in self.layers]
        # None: some layer is no segment, and torch copies them.
        self._segments = [s.as_tuple() for s in segments if s is not None] if None not in segments else None
        self._cpu = all(t.device.type == "cpu" for t, _ in self.layers)

    def gather(self, blocks: Sequence[int], buffer: torch.Tensor, threads: int = 1) -> None:
        """Row ``i`` of ``buffer`` (uint8, one row per block) <- block ``blocks[i]`` of every layer."""
        self._move(blocks, buffer, threads, to_buffer=True)

    def scatter(self, blocks: Sequence[int], buffer: torch.Tensor, threads: int = 1) -> None:
        """Block ``blocks[i]`` of every layer <- row ``i`` of ``buffer``."""
        self._move(blocks, buffer, threads, to_buffer=False)

    def _move(self, blocks: Sequence[int], buffer: torch.Tensor, threads: int, to_buffer: bool) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.stride(1) != 1:
            raise ValueError("buffer: a uint8 tensor of rows (one per block), each row contiguous")
        if buffer.shape[0] < len(blocks) or buffer.shape[1] < self.payload_bytes:
            raise ValueError(
                f"buffer: {tuple(buffer.shape)} holds fewer than {len(blocks)} rows of {self.payload_bytes} bytes"
            )
        native = _native is not None and self._segments is not None and len(blocks) > 0
        if native and self._cpu and buffer.device.type == "cpu":
            fn: Any = _native.gather if to_buffer else _native.scatter
            fn(self._segments, list(blocks), buffer.data_ptr(), buffer.stride(0), threads)
        elif native and reachable(self.layers, buffer) and cuda_available():
            stream = torch.cuda.current_stream(self.layers[0][0].device).cuda_stream
            _native.cuda_move(self._segments, list(blocks), buffer.data_ptr(), buffer.stride(0), to_buffer, stream)
        else:
            torch_move(self.layers, blocks, buffer, to_buffer)


def gather(
    layers: Sequence[tuple[torch.Tensor, int]], blocks: Sequence[int], buffer: torch.Tensor, threads: int = 1
) -> None:
    """Row ``i`` of ``buffer`` (uint8, one row per block) <- block ``blocks[i]`` of every layer."""
    Copier(layers).gather(blocks, buffer, threads)


def scatter(
    layers: Sequence[tuple[torch.Tensor, int]], blocks: Sequence[int], buffer: torch.Tensor, threads: int = 1
) -> None:
    """Block ``blocks[i]`` of every layer <- row ``i`` of ``buffer``."""
    Copier(layers).scatter(blocks, buffer, threads)


def reachable(layers: Sequence[tuple[torch.Tensor, int]], buffer: torch.Tensor) -> bool:
    """The kernel runs on the layers' one GPU and dereferences the buffer there: device memory of
    that GPU, or pinned host memory (pageable memory would fault)."""
    gpus = {t.device for t, _ in layers}
    if len(gpus) != 1 or next(iter(gpus)).type != "cuda":
        return False
    return buffer.device in gpus or (buffer.device.type == "cpu" and buffer.is_pinned())


def torch_move(
    layers: Sequence[tuple[torch.Tensor, int]], blocks: Sequence[int], buffer: torch.Tensor, to_buffer: bool
) -> None:
    """The reference: per layer, index the blocks and copy their bytes."""
    idx = torch.as_tensor(list(blocks), dtype=torch.long, device=layers[0][0].device)
    offset = 0
    n = len(blocks)
    for tensor, dim in layers:
        width = tensor.numel() // tensor.shape[dim] * tensor.element_size()
        rows = buffer[:n, offset : offset + width]
        if to_buffer:
            picked = tensor.index_select(dim, idx).movedim(dim, 0).contiguous()
            rows.copy_(picked.view(n, -1).view(torch.uint8).to(buffer.device))
        else:
            shape = [n, *(s for i, s in enumerate(tensor.shape) if i != dim)]
            values = rows.to(tensor.device).contiguous().view(tensor.dtype).view(shape).movedim(0, dim)
            tensor.index_copy_(dim, idx, values)
        offset += width
