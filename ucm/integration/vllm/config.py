"""``kv_connector_extra_config`` of UCMConnector: validated once, errors naming the field."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import ByteSize, Field

from ucm import ucm_style
from ucm.config import ConfigError, StrictModel, parse_config
from ucm.hashing import HASH_ALGORITHMS, HashAlgorithm
from ucm.sparse.config import SparseConfig, from_ucm
from ucm.store import validate_store_config
from ucm.store.breaker import BreakerConfig
from ucm.store.factory import parse_spec

# vLLM's connector API changes between minor versions; this is the range the tests run against.
SUPPORTED_VLLM = ((0, 32), (0, 33))  # [lower, upper)

WHERE = "kv_connector_extra_config"
# The model class an engine that blends runs (ucm.integration.vllm.blend_model), named in its
# --hf-overrides: see blend_overrides.
BLEND_ARCHITECTURE = "UCMBlendLlamaForCausalLM"


def blend_overrides() -> dict[str, list[str]]:
    """vLLM's ``--hf-overrides`` for an engine that blends (a Llama-shaped model)."""
    return {"architectures": [BLEND_ARCHITECTURE]}


# Which reused tokens Blend recomputes (BlendConfig.selection).
Selection = Literal["deviation", "attention"]


class BlendConfig(StrictModel):
    """Blend (CacheBlend): reuse the cached KV of text chunks wherever a prompt places them. A prompt is
    cut into chunks at each occurrence of ``separator``; the part after the last one (the question)
    is always computed. A chunk's KV is found in the store under the ids its tokens would have as
    a prompt of their own (so a chunk is cached by prefilling it alone, or as a prompt's start)."""

    separator: str = Field(
        "\n---\n",
        min_length=1,
        description="Text between chunks, matched as the tokens the model's tokenizer makes of it alone: choose "
        "text whose tokens do not merge with their neighbours' (a line of its own does not)",
    )
    recompute_ratio: float = Field(
        0.3, ge=0, le=1, description="Share of the reused tokens recomputed (which ones: see selection)"
    )
    check_layer: int = Field(
        1, ge=0, description="Layer where the tokens to recompute are chosen: it and those below run for every token"
    )
    selection: Selection = Field(
        "attention",
        description="Which reused tokens are recomputed: 'deviation' (CacheBlend's: their KV at check_layer "
        "deviates most from a fresh computation) or 'attention' (the question's: the tokens without a cached KV "
        "run ahead through the later layers first, and those the question attends to most there are recomputed; "
        "the blend then covers the question too)",
    )
    recompute_chunk_start: int = Field(
        16,
        ge=0,
        description="Tokens at the start of each chunk always recomputed: computed alone, a chunk's first tokens "
        "drew the attention a prompt's first tokens draw (a sink), which they must not keep mid-prompt",
    )
    max_chunks: int = Field(64, ge=1, description="A prompt with more chunks than this is prefilled as usual")
    max_blend_tokens: int = Field(
        16384,
        ge=1,
        description="Most tokens one request blends in a step (blending runs outside vLLM's token budget); a longer "
        "region is prefilled as usual (with the attention selection, one whose question would pass it ends at the "
        "chunks and selects by deviation)",
    )


class ConnectorConfig(StrictModel):
    """UCMConnector's options, validated wherever they are written or read (the operator, ``ucm up``,
    ``ucm serve``, and the connector in vLLM's scheduler and workers): an unknown key or a bad value is
    an error naming the field."""

    store: dict[str, Any] = Field(description="Store configuration: {'spec': 'cache|posix', 'posix': {...}}")
    hash_algorithm: HashAlgorithm = Field("sha256", description=f"One of {', '.join(HASH_ALGORITHMS)}")
    model_id: str | None = Field(
        None,
        description="Model identity bound into block ids; default: the model path or name vLLM was given. "
        "Set it when instances load the same model from different paths.",
    )
    salt: str = Field(
        "", description="Deployment salt; a request's cache_salt is hashed beside it (never concatenated)"
    )
    load_mode: Literal["layer", "step"] = Field(
        "layer", description="layer: copy loaded blocks into each layer just before it runs; step: all up front"
    )
    save_mode: Literal["layer", "step"] = Field(
        "layer", description="layer: copy each layer's new blocks as it finishes; step: all at the step's end"
    )
    load_failure: Literal["recompute", "fail"] = Field(
        "recompute", description="What vLLM does with blocks that fail to load"
    )
    pd_wait_timeout_s: float = Field(
        30.0, ge=0, description="A consumer waits this long for blocks a producer promised, then recomputes"
    )
    pd_save_wait_s: float = Field(
        10.0,
        ge=0,
        description="A PD prefill answers only once its blocks are in the store, waiting up to this long: decode "
        "finds them at once, and a prefill stopped right after answering has lost nothing (vLLM kills its "
        "workers on exit). 0: answer at once, the blocks land later",
    )
    load_timeout_s: float | None = Field(
        10.0,
        gt=0,
        description="A load not done by then is abandoned and its blocks recomputed; loads are then staged (an "
        "abandoned read must not land in cache memory vLLM reuses). null: no deadline, CPU loads in place",
    )
    load_staging: ByteSize = Field(
        ByteSize(128 << 20),
        description="Host staging kept across steps for loads, saves and Blend's chunk reads (fresh memory "
        "page-faults on first touch): allocated and touched at startup when loads are staged, so a first load pays "
        "no page faults; a larger transfer allocates more, and of what comes back the largest buffer is kept and "
        "others up to this size",
    )
    decode_save_blocks: int = Field(
        64, ge=0, description="Blocks filled while decoding that are saved too, per request (0: prompt blocks only)"
    )
    store_tp: int | None = Field(
        None,
        ge=1,
        description="How many shares (by KV heads) each block is kept in, in the store; default: the engine's "
        "tensor-parallel size. Pools of different TP share blocks when both set it to the larger TP: an engine "
        "whose TP divides it reads and writes store_tp / TP shares per rank",
    )
    lookup_timeout_s: float = Field(
        2.0,
        gt=0,
        description="The store lookups of one scheduler step together take at most this long: a lookup not "
        "answered by then counts as a miss, and the step's later lookups are misses at once",
    )
    store_unhealthy_after_s: float | None = Field(
        10.0,
        gt=0,
        description="The engine's /health says X-UCM-Store: degraded once a store call has been stuck this long "
        "(with ucm serve, which adds the middleware; the engine keeps serving without the store, and the proxy "
        "sends requests straight to decode); null: never",
    )
    store_breaker: BreakerConfig | None = Field(
        default_factory=BreakerConfig,
        description="Workers skip a store whose loads and saves time out several in a row (loads are recomputed, "
        "saves dropped) until a probe is answered in time; /health says so after store_unhealthy_after_s of "
        "it. null: never skip the store",
    )
    huge_pages: bool = Field(
        True,
        description="A host (CPU) KV cache and sparse off-load's arena go on transparent 2 MiB pages, which the "
        "node's transparent_hugepage mode 'madvise' gives only when asked: far fewer TLB misses where decode reads "
        "blocks scattered over the cache (sparse attention). No effect on a GPU's cache, where the mode is 'never', "
        "or in a process with huge pages disabled (PR_SET_THP_DISABLE)",
    )
    sparse: SparseConfig | None = Field(None, description="Sparse attention for long decodes (ucm.sparse)")
    blend: BlendConfig | None = Field(
        None, description="Reuse chunks' KV wherever they appear in a prompt (Blend); null: prefixes only"
    )


def parse_connector_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    config = parse_config(ConnectorConfig, native_config(extra or {}), WHERE)
    with prefixed_errors():
        validate_store_config(config.store)
    return config


def native_config(extra: Mapping[str, Any], where: str = WHERE) -> dict[str, Any]:
    """A kv_connector_extra_config in our shape: UCM's keys (``ucm_connectors``,
    ``ucm_config_path``, ``ucm_sparse_config``, ...) translated, errors naming them under ``where``."""
    return with_sparse_translated(ucm_style.translate(extra, where), where)


def with_sparse_translated(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``options`` with UCM's ``ucm_sparse_config`` (if any) turned into our ``sparse`` section, or
    into ``blend`` when it chooses UCM's Blend."""
    out = dict(options)
    if "ucm_sparse_config" in out:
        ucm = out.pop("ucm_sparse_config")
        section = "blend" if _chooses_blend(ucm) else "sparse"
        if section in out:
            raise ConfigError(f"{where}: give {section} or ucm_sparse_config, not both")
        where = f"{where}.ucm_sparse_config"
        out[section] = blend_from_ucm(ucm, where) if section == "blend" else from_ucm(ucm, where)
    return out


def _chooses_blend(ucm: Any) -> bool:
    if not isinstance(ucm, Mapping):
        return False
    return ucm.get("sparse_type") == "Blend" or set(ucm) - {"sparse_type"} == {"Blend"}


def blend_from_ucm(ucm: Mapping[str, Any], where: str) -> dict[str, Any]:
    """UCM's ``{"Blend": {"compute_meta": {"model.layers.N.self_attn": {"ratio": r}}}}`` as our
    ``blend`` section: layer N measures the deviation, ``r`` is the share recomputed. Our own keys
    (``separator``, ...) may sit beside ``compute_meta``. One layer only: UCM lets later layers
    narrow the selection again, which this Blend does not do."""
    section = ucm.get("Blend") or {}
    where = f"{where}.Blend"
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where}: expected a mapping such as {{compute_meta: {{...}}}}")
    out = {k: v for k, v in section.items() if k != "compute_meta"}
    meta = section.get("compute_meta")
    if meta is None:
        return out
    if not isinstance(meta, Mapping) or len(meta) != 1:
        raise ConfigError(
            f"{where}.compute_meta: give one layer, e.g. {{'model.layers.1.self_attn': {{'ratio': 0.15}}}} "
            "(a selection narrowed again at later layers is not supported)"
        )
    ((layer, options),) = meta.items()
    found = re.fullmatch(r"model\.layers\.(\d+)\.self_attn", str(layer))
    if found is None:
        raise ConfigError(f"{where}.compute_meta.{layer}: expected a layer named model.layers.<N>.self_attn")
    if not isinstance(options, Mapping) or set(options) != {"ratio"}:
        raise ConfigError(f"{where}.compute_meta.{layer}: expected {{ratio: <share recomputed>}}")
    return {**out, "check_layer": int(found.group(1)), "recompute_ratio": options["ratio"]}


def sparse_config(options: Mapping[str, Any] | None, where: str) -> SparseConfig | None:
    """The sparse section of a mapping (``sparse`` or UCM's ``ucm_sparse_config``), validated."""
    section = native_config(options or {}, where).get("sparse")
    return None if section is None else parse_config(SparseConfig, section, f"{where}.sparse")


KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


def kv_transfer_config(store: dict[str, Any], role: KVRole = "kv_both", **extra: Any) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` that loads UCMConnector with this store and extra options.

    The one place the shape is written: tests, benchmarks, the operator and ``ucm up`` all use it."""
    config = {"store": store, **extra}
    parse_connector_config(config)  # fail here, naming the field, rather than in vLLM's startup
    return {
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm.integration.vllm",
        "kv_role": role,
        "kv_connector_extra_config": config,
    }


def scheduler_store_config(store: dict[str, Any]) -> dict[str, Any]:
    """The store as vLLM's scheduler process uses it: lookups only. A Mooncake client there would
    otherwise add a whole segment of DRAM to the pool that no block is ever written to."""
    if "mooncake" not in parse_spec(store["spec"]):
        return store
    return {**store, "mooncake": {**(store.get("mooncake") or {}), "global_segment_size": 0}}


@contextmanager
def prefixed_errors() -> Iterator[None]:
    """Store errors name ``store.<field>``; say where that store config lives."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{WHERE}.{exc}") from None


# Parallel layouts whose KV a worker's key cannot name yet: a context-parallel worker holds only
# some tokens of each block.
UNSUPPORTED_PARALLEL = ("decode_context_parallel_size", "prefill_context_parallel_size")


def check_parallel_layout(parallel: Any) -> None:
    """Refuse layouts the store keys cannot tell apart (tensor and pipeline parallel are bound)."""
    for name in UNSUPPORTED_PARALLEL:
        size = getattr(parallel, name, 1) or 1
        if size > 1:
            raise ConfigError(
                f"UCMConnector: {name}={size} is not supported: a context-parallel worker holds only some "
                "tokens of each block, which its store key cannot name yet. Run with it at 1."
            )


def shares_per_rank(store_tp: int | None, tp: int, pp: int, kv_heads: int, blend: bool, mla: bool = False) -> int:
    """How many shares of each block one worker keeps in the store (``store_tp / tp``), the layout
    checked: ``kv_heads`` is the model's KV head count, so that each share is a whole range of heads."""
    if store_tp is None or store_tp == tp:
        return 1
    where = f"{WHERE}.store_tp"
    if mla:
        raise ConfigError(
            f"{where}: a model with multi-head latent attention keeps one latent KV head, copied on every rank; "
            "it cannot be split into shares by heads (run both pools with the same tensor_parallel_size)"
        )
    if store_tp % tp:
        raise ConfigError(
            f"{where}: {store_tp} is not a multiple of this engine's tensor_parallel_size {tp}: a rank must "
            "hold whole shares of a block (give both pools the larger TP, when it is a multiple of the smaller)"
        )
    if pp > 1:
        raise ConfigError(f"{where}: shares of a different TP need pipeline_parallel_size 1, got {pp}")
    if kv_heads % store_tp:
        raise ConfigError(f"{where}: the model's {kv_heads} KV heads do not split into {store_tp} equal shares")
    if blend:
        raise ConfigError(f"{where}: blend needs store_tp equal to the engine's tensor_parallel_size")
    return store_tp // tp


def check_vllm_version(version: str) -> None:
    parts = version.split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        raise ConfigError(f"UCMConnector: cannot parse vLLM version {version!r}") from None
    lo, hi = SUPPORTED_VLLM
    if not lo <= major_minor < hi:
        raise ConfigError(
            f"UCMConnector supports vLLM >= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}; this is vLLM {version}. "
            "Install a supported vLLM or a UCM release made for this one."
        )
