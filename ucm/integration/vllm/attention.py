"""Sparse attention inside vLLM's CPU attention backend, without patching vLLM.

``ucm.integration.vllm.plugin`` (a ``vllm.general_plugins`` entry point, run in every vLLM process)
registers :class:`UCMAttentionBackend` in place of ``CPU_ATTN``. With no sparse configuration it
*is* the CPU backend (subclasses that defer to it). With one — ``sparse`` or UCM's
``ucm_sparse_config`` in UCMConnector's ``kv_connector_extra_config``, or the same keys in vLLM's
``--additional-config`` for an engine without the connector:

- every key written into the cache is folded into its block's summary (``do_kv_cache_update``);
- once per step the metadata builder plans which rows decode sparsely (``ucm.sparse.serving``);
- in each sparse layer one native call selects, per (request, KV head), the blocks to attend, and
  vLLM's own kernel attends them: the cache is viewed as ``(blocks * kv_heads, 1, block_size,
  head_dim)``, so that row ``phys * kv_heads + head`` is one head of one block, and each
  (request, KV head) becomes a row of that call with its group's query heads. Other rows (prefill
  chunks, short requests) go through the kernel as before, in a call of their own;
- with off-load (``offload_blocks``), a dense layer attends the off-loaded requests in a call of
  their own too, over the layer's arena (``SparseRuntime.offloaded_cache``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from ucm.config import ConfigError
from ucm.cpu import native_bfloat16
from ucm.integration.vllm.config import WHERE, sparse_config
from ucm.sparse.config import SparseConfig
from ucm.sparse.serving import RUNTIMES, SparseRuntime, StepPlan, cache_keys, cache_planes
from ucm.sparse.summaries import native_available
from ucm.ucm_style import CONNECTOR_NAMES

logger = logging.getLogger(__name__)


@functools.cache  # once per process: the builder is made per KV cache group
def _warn_emulated_bfloat16() -> None:
    logger.warning(
        "this engine computes in bfloat16 on a CPU without bfloat16 arithmetic (no AVX512-BF16 or AMX): "
        "expect it ~100x slower than float32 here (vLLM's --dtype auto picks bfloat16 on CPUs); "
        "set --dtype float32 (spec.model.dtype: float32)"
    )


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
    if len(found) == 1 and given and given[0].offload_blocks:
        raise ConfigError(
            "additional_config.sparse.offload_blocks: needs UCMConnector (its scheduler half frees the blocks); "
            f"configure sparse in {WHERE}"
        )
    return given[0] if given else None


def learn_layout(dtype: torch.dtype, isa: str, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the kernel's cache writer puts token ``t``, channel ``d`` of a block's keys and of its
    values: ``positions[t * head_dim + d]`` (int32) within one head's ``block_size * head_dim``
    elements."""
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
        layouts.append(positions.to(torch.int32))
    return layouts[0], layouts[1]


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """What vLLM's CPU kernel schedule depends on, besides the lengths: fixed per KV cache group."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    isa: str
    kv_cache_dtype: str

    def __post_init__(self) -> None:
        # AMX tiles need the kernel's leave per process (arch_prctl ARCH_REQ_XCOMP_PERM), or their
        # first instruction is SIGILL. A vLLM engine gets it from oneDNN's first bf16 matmul; a
        # process that only attends through this kernel (a benchmark, a test) asks here.
        if self.isa == "amx" and not torch.cpu._init_amx():
            raise ConfigError("sparse: vLLM chose its AMX attention kernel, but the kernel refused AMX to this process")

    def schedule(self, seq_lens: torch.Tensor, starts: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=self.head_dim,
            seq_lens=seq_lens,
            dtype=self.dtype,
            query_start_loc=starts,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def per_head_schedule(self, lens: torch.Tensor) -> torch.Tensor:
        """For one query token per (request, KV head), with that KV head only."""
        starts = torch.arange(len(lens) + 1, dtype=torch.int32)
        return self.schedule(lens, starts, self.num_heads // self.num_kv_heads, 1)


@dataclasses.dataclass
class UCMAttentionMetadata(CPUAttentionMetadata):
    sparse: SparseRuntime | None = None
    sparse_plan: StepPlan | None = None
    sparse_layout: tuple[torch.Tensor, torch.Tensor] | None = None  # see learn_layout
    sparse_shape: KernelShape | None = None
    sparse_schedule: torch.Tensor | None = None  # the per-head kernel schedule for the plan's lengths
    sparse_starts: torch.Tensor | None = None  # (R * Hkv + 1,) one query token per (request, KV head)
    # The other rows' metadata in sparse layers (sparse rows narrowed to one token); None: no other rows.
    sparse_others: CPUAttentionMetadata | None = None
    # Dense layers with off-loaded rows: the batch with those rows narrowed to one token, and the
    # schedule of their own call. Made by the first dense layer: the plan learns which rows are
    # off-loaded after the metadata is built (the connector's metadata is bound later).
    offload_others: CPUAttentionMetadata | None = None
    offload_schedule: torch.Tensor | None = None


def narrowed(metadata: CPUAttentionMetadata, rows: torch.Tensor, shape: KernelShape) -> CPUAttentionMetadata:
    """The step's metadata with ``rows`` attending one token (their output is replaced)."""
    seq_lens = metadata.seq_lens.clone()
    seq_lens[rows] = 1
    return dataclasses.replace(
        metadata,
        seq_lens=seq_lens,
        max_seq_len=int(seq_lens.max()),
        scheduler_metadata=shape.schedule(seq_lens, metadata.query_start_loc, shape.num_heads, shape.num_kv_heads),
    )


def offload_metadata(md: UCMAttentionMetadata) -> CPUAttentionMetadata | None:
    """The step's metadata for dense layers with off-loaded rows, made by the first of them: the
    other rows' (None: none) and the off-loaded rows' own schedule (``md.offload_schedule``)."""
    plan, shape = md.sparse_plan, md.sparse_shape
    assert plan is not None and plan.offloaded is not None and shape is not None
    if md.offload_schedule is None:
        rows = plan.offloaded
        md.offload_others = narrowed(md, rows.rows, shape) if len(rows.rows) < len(md.seq_lens) else None
        starts = torch.arange(len(rows.rows) + 1, dtype=torch.int32)
        md.offload_schedule = shape.schedule(rows.seq_lens, starts, shape.num_heads, shape.num_kv_heads)
    return md.offload_others


def sparse_metadata(
    metadata: CPUAttentionMetadata,
    runtime: SparseRuntime,
    plan: StepPlan,
    layout: tuple[torch.Tensor, torch.Tensor],
    shape: KernelShape,
) -> UCMAttentionMetadata:
    """The step's metadata for sparse layers: the plan, the per-head call's schedule, and the other
    rows' metadata with the sparse rows narrowed to one token (their output is replaced)."""
    others = narrowed(metadata, plan.rows, shape) if len(plan.rows) < len(metadata.seq_lens) else None
    fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(CPUAttentionMetadata)}
    return UCMAttentionMetadata(
        **fields,
        sparse=runtime,
        sparse_plan=plan,
        sparse_layout=layout,
        sparse_shape=shape,
        sparse_schedule=shape.per_head_schedule(plan.lens),
        sparse_starts=torch.arange(len(plan.lens) + 1, dtype=torch.int32),
        sparse_others=others,
    )


def attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    starts: torch.Tensor,
    seq_lens: torch.Tensor,
    table: torch.Tensor,
    schedule: torch.Tensor,
    *,
    scale: float,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """vLLM's CPU kernel, causal, without ALiBi, sliding window or sinks: ``query`` rows from
    ``starts`` attend ``seq_lens`` tokens of the blocks ``table`` names in the caches (each
    ``(blocks, kv_heads, block_size, D)`` as the kernel reads them)."""
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=starts,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=table,
        softcap=softcap,
        scheduler_metadata=schedule,
        s_aux=None,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )


class UCMAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.dtype == torch.bfloat16 and not native_bfloat16():
            _warn_emulated_bfloat16()
        config = configured_sparse(vllm_config)
        decoder = not (self.is_cross_attention or self.is_encoder_only_attention)
        self.runtime = None
        if config is not None and decoder:
            if self.kv_cache_dtype != "auto":
                raise ConfigError(f"sparse: needs the KV cache in the model's dtype, not {self.kv_cache_dtype}")
            if self.window_size != -1:
                raise ConfigError("sparse: models with sliding-window attention are not supported")
            if not native_available():
                raise ConfigError("sparse: needs UCM's native module ucm_native (make dev builds it)")
            self.layout = learn_layout(self.dtype, self.isa, self.block_size, self.head_dim)
            self.runtime = SparseRuntime(
                config, self.block_size, self.num_kv_heads, self.head_dim, list(layer_names), self.layout[0]
            )
            self.shape = KernelShape(
                self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.isa, self.kv_cache_dtype
            )
            for name in layer_names:
                RUNTIMES[name] = self.runtime

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.runtime is None:
            return metadata
        plan = self.runtime.begin_step(
            metadata.block_table, metadata.seq_lens, common_attn_metadata.query_start_loc_cpu
        )
        if plan is None:
            return metadata
        return sparse_metadata(metadata, self.runtime, plan, self.layout, self.shape)


class UCMAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.alibi_slopes is None and self.sinks is None:
            return
        # Such layers attend through vLLM's own call (sparse or not), which would read the blocks
        # off-load freed: refused before the model loads rather than decoding wrong tokens.
        config = configured_sparse(get_current_vllm_config())
        if config is not None and config.offload_blocks:
            raise ConfigError(
                f"{WHERE}.sparse.offload_blocks: models with ALiBi or attention sinks cannot off-load; "
                "leave offload_blocks out"
            )

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        runtime = RUNTIMES.get(layer.layer_name)
        if runtime is not None and self.attn_type == AttentionType.DECODER and runtime.sparse_layer(layer.layer_name):
            runtime.write(layer.layer_name, key, slot_mapping, kv_cache.shape[0], kv_cache.dtype)

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
        md = attn_metadata
        runtime = RUNTIMES.get(layer.layer_name)
        if (
            isinstance(md, UCMAttentionMetadata)
            and md.sparse_plan is not None
            and md.sparse_plan.offloaded is not None
            and self.attn_type == AttentionType.DECODER
            and runtime is not None
            and not runtime.sparse_layer(layer.layer_name)
        ):
            others = offload_metadata(md)
            if others is not None:
                super().forward(layer, query, key, value, kv_cache, others, output, output_scale, output_block_scale)
            self._offloaded_rows(layer, query, kv_cache, md, output)
            return output
        if (
            runtime is not None
            and runtime.window
            and md is not None
            and self.attn_type == AttentionType.DECODER
            and runtime.sparse_layer(layer.layer_name)
        ):
            runtime.observe(
                layer.layer_name,
                query,
                cache_keys(kv_cache),
                md.query_start_loc,
                md.seq_lens,
                md.block_table,
                self.scale,
            )
        if (
            not isinstance(md, UCMAttentionMetadata)
            or md.sparse is None
            or self.attn_type != AttentionType.DECODER
            or not md.sparse.sparse_layer(layer.layer_name)
            or self.sinks is not None
            or self.alibi_slopes is not None
        ):
            return super().forward(layer, query, key, value, kv_cache, md, output, output_scale, output_block_scale)
        if md.sparse_others is not None:
            super().forward(
                layer, query, key, value, kv_cache, md.sparse_others, output, output_scale, output_block_scale
            )
        self._sparse_rows(layer, query, kv_cache, md, output)
        return output

    def _offloaded_rows(
        self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, md: UCMAttentionMetadata, output: torch.Tensor
    ) -> None:
        """A dense layer's off-loaded rows, in a call of their own over every block they hold, the
        arena's included."""
        runtime, plan = md.sparse, md.sparse_plan
        assert runtime is not None and plan is not None and plan.offloaded is not None
        assert md.offload_schedule is not None
        rows = plan.offloaded
        output = output.view(len(output), self.num_heads, -1)
        out = torch.empty_like(output[rows.tokens])
        attend(
            query[rows.tokens].reshape(len(rows.rows), self.num_heads, -1),
            *runtime.offloaded_cache(layer.layer_name, kv_cache).chunk(2, dim=2),
            out,
            torch.arange(len(rows.rows) + 1, dtype=torch.int32),
            rows.seq_lens,
            rows.tables,
            md.offload_schedule,
            **self._kernel_options(layer),
        )
        output[rows.tokens] = out

    def _kernel_options(self, layer: Any) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "softcap": self.logits_soft_cap,
            "k_scale": layer._k_scale_float,
            "v_scale": layer._v_scale_float,
            "kv_cache_dtype": self.kv_cache_dtype,
        }

    def _sparse_rows(
        self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, md: UCMAttentionMetadata, output: torch.Tensor
    ) -> None:
        """Attention of the sparse rows over the blocks each of their KV heads selected."""
        plan, runtime = md.sparse_plan, md.sparse
        assert plan is not None and runtime is not None and md.sparse_layout is not None
        hkv = kv_cache.shape[1]
        table, lens = runtime.select(layer.layer_name, query, kv_cache, md.sparse_layout[0], self.scale)
        schedule = md.sparse_schedule
        if lens is not plan.lens:  # an adaptive budget: lengths differ per layer
            assert md.sparse_shape is not None
            schedule = md.sparse_shape.per_head_schedule(lens)
        g = self.num_heads // hkv
        rows = len(plan.rows)
        output = output.view(len(output), self.num_heads, -1)
        tokens = plan.tokens.long()
        contiguous = int(tokens[-1]) == rows - 1  # the sparse rows are the step's first tokens
        q = query[:rows] if contiguous else query[tokens]
        out = output[:rows] if contiguous else torch.empty_like(q)
        assert md.sparse_starts is not None and schedule is not None
        attend(
            q.reshape(rows * hkv, g, -1),
            *cache_planes(kv_cache).unsqueeze(1).chunk(2, dim=2),  # one KV head per block: row phys * Hkv + head
            out.view(rows * hkv, g, -1),
            md.sparse_starts,
            lens,
            table,
            schedule,
            **self._kernel_options(layer),
        )
        if not contiguous:
            output[tokens] = out


class UCMAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[UCMAttentionImpl]:
        return UCMAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[UCMAttentionMetadataBuilder]:
        return UCMAttentionMetadataBuilder
