"""Sparse attention inside vLLM's CPU attention backend, without patching vLLM.

``ucm.integration.vllm.plugin`` (a ``vllm.general_plugins`` entry point, run in every vLLM process)
registers :class:`UCMAttentionBackend` in place of ``CPU_ATTN``. With no sparse configuration it
*is* the CPU backend (subclasses that defer to it). With one — ``sparse`` or UCM's
``ucm_sparse_config`` in UCMConnector's ``kv_connector_extra_config``, or the same keys in vLLM's
``--additional-config`` for an engine without the connector — the metadata builder marks the rows
of each step that decode sparsely (``ucm.sparse.serving``), and each layer's forward gives those
rows a block table holding only the blocks the algorithm chose (ending with the block being
written) and the matching length, then runs vLLM's own kernel: attention reads exactly those
blocks. Prefill chunks and short requests keep their rows. PSA attends as it selects: its output
replaces the kernel's for its rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from ucm.config import ConfigError
from ucm.integration.vllm.config import WHERE, sparse_config
from ucm.sparse.base import BlockReader
from ucm.sparse.config import SparseConfig
from ucm.sparse.serving import RequestState, SparseRuntime
from ucm.ucm_style import CONNECTOR_NAMES


def configured_sparse(vllm_config: VllmConfig) -> SparseConfig | None:
    """The engine's sparse configuration: from UCMConnector's extra config or ``--additional-config``."""
    found = []
    kv = vllm_config.kv_transfer_config
    if kv is not None and kv.kv_connector in CONNECTOR_NAMES:
        found.append(sparse_config(kv.kv_connector_extra_config, WHERE))
    extra = vllm_config.additional_config
    if isinstance(extra, dict):
        found.append(sparse_config(extra, "additional_config"))
    given = [c for c in found if c is not None]
    if len(given) > 1:
        raise ConfigError(f"sparse: configured both in {WHERE} and in additional_config; keep one")
    return given[0] if given else None


def learn_layout(dtype: torch.dtype, isa: str, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the kernel's cache writer puts token ``t``, channel ``d`` of a block's keys and of its
    values: ``positions[t * head_dim + d]`` within one head's ``block_size * head_dim`` elements."""
    cache = torch.zeros(1, 1, 2 * block_size, head_dim, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    t = torch.arange(block_size, dtype=torch.float32)[:, None, None].expand(block_size, 1, head_dim)
    d = torch.arange(head_dim, dtype=torch.float32)[None, None, :].expand(block_size, 1, head_dim)
    slots = torch.arange(block_size, dtype=torch.int64)
    found = []
    for probe in (t, d):  # small integers: exact in every cache dtype
        tokens = probe.to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(tokens, tokens, key_cache, value_cache, slots, isa)
        found.append((key_cache.flatten().long(), value_cache.flatten().long()))
    layouts = []
    for tokens, channels in zip(*found, strict=True):
        logical = tokens * head_dim + channels  # what lies at each stored position
        if not torch.equal(torch.sort(logical).values, torch.arange(block_size * head_dim)):
            raise ConfigError(f"sparse: vLLM's CPU KV cache layout for isa {isa!r} is not one UCM can read")
        positions = torch.empty_like(logical)
        positions[logical] = torch.arange(len(logical))
        layouts.append(positions)
    return layouts[0], layouts[1]


@dataclasses.dataclass
class UCMAttentionMetadata(CPUAttentionMetadata):
    sparse: SparseRuntime | None = None
    sparse_rows: list[RequestState | None] | None = None  # per row: its state when it decodes sparsely
    sparse_layout: tuple[torch.Tensor, torch.Tensor] | None = None  # see learn_layout
    # The kernel's scheduler metadata for narrowed lengths, shared by the step's layers (most
    # layers narrow the rows to the same lengths).
    sparse_schedules: dict[tuple[int, ...], torch.Tensor] = dataclasses.field(default_factory=dict)


class UCMAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = configured_sparse(vllm_config)
        decoder = not (self.is_cross_attention or self.is_encoder_only_attention)
        self.runtime = None
        if config is not None and decoder:
            if self.kv_cache_dtype != "auto":
                raise ConfigError(f"sparse: needs the KV cache in the model's dtype, not {self.kv_cache_dtype}")
            self.runtime = SparseRuntime(config, self.block_size, self.num_kv_heads, self.head_dim)
            self.layout = learn_layout(self.dtype, self.isa, self.block_size, self.head_dim)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.runtime is None:
            return metadata
        starts = common_attn_metadata.query_start_loc_cpu
        query_lens = (starts[1:] - starts[:-1]).tolist()
        rows = self.runtime.begin_step(metadata.block_table, metadata.seq_lens.tolist(), query_lens)
        if not any(rows):
            return metadata
        fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        return UCMAttentionMetadata(**fields, sparse=self.runtime, sparse_rows=rows, sparse_layout=self.layout)


class UCMAttentionImpl(CPUAttentionBackendImpl):
    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            not isinstance(attn_metadata, UCMAttentionMetadata)
            or attn_metadata.sparse is None
            or self.attn_type != AttentionType.DECODER
        ):
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        sparse_metadata, replaced = self._select(layer, query, kv_cache, attn_metadata)
        super().forward(layer, query, key, value, kv_cache, sparse_metadata, output, output_scale, output_block_scale)
        for token, out in replaced:
            output[token].copy_(out.reshape(output[token].shape))
        return output

    def _select(
        self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, md: UCMAttentionMetadata
    ) -> tuple[CPUAttentionMetadata, list[tuple[int, torch.Tensor]]]:
        """The step's metadata with each sparse row narrowed to its selected blocks."""
        assert md.sparse is not None and md.sparse_rows is not None and md.sparse_layout is not None
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
        key_positions, value_positions = md.sparse_layout
        keys = BlockReader(key_cache.flatten(2), key_positions, block_size, self.head_size)
        values = BlockReader(value_cache.flatten(2), value_positions, block_size, self.head_size)
        table, seq_lens = md.block_table.clone(), md.seq_lens.clone()
        starts = md.query_start_loc
        replaced: list[tuple[int, torch.Tensor]] = []
        for i, state in enumerate(md.sparse_rows):
            if state is None:
                continue
            seq = state.seq_len
            n = -(-seq // block_size)
            block_ids = md.block_table[i, :n].long()
            token = int(starts[i])
            q = query[token].view(self.num_heads, self.head_size)
            chosen = md.sparse.select(layer.layer_name, state, q, keys, values, block_ids)
            k = len(chosen.physical)
            table[i, :k] = chosen.physical
            seq_lens[i] = (k - 1) * block_size + seq - (n - 1) * block_size
            if chosen.output is not None:
                replaced.append((token, chosen.output))
        lengths = tuple(seq_lens.tolist())
        scheduler_metadata = md.sparse_schedules.get(lengths)
        if scheduler_metadata is None:
            scheduler_metadata = md.sparse_schedules[lengths] = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(md.sparse_rows),
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size,
                seq_lens=seq_lens,
                dtype=query.dtype,
                query_start_loc=starts,
                causal=md.causal,
                sliding_window_size=self.sliding_window,
                isa=layer.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                dynamic_causal=md.dynamic_causal,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        narrowed = dataclasses.replace(
            md,
            block_table=table,
            seq_lens=seq_lens,
            max_seq_len=int(seq_lens.max()),
            scheduler_metadata=scheduler_metadata,
        )
        return narrowed, replaced


class UCMAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[UCMAttentionImpl]:
        return UCMAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[UCMAttentionMetadataBuilder]:
        return UCMAttentionMetadataBuilder
