"""Sparse attention settings for serving: UCM's shape and ours, validated, one model.

Ours: ``{"algorithm": "esa", "min_tokens": 1024, "esa": {"sparse_ratio": 0.3, ...}}``: the chosen
algorithm's options sit under its name (only that one's). UCM's own shape is accepted too and
translated (:func:`from_ucm`): ``{"ESA": {...}}``, ``{"sparse_type": "KVStarMultiStep",
"KVStarMultiStep": {...}}``, ``GSA``, ``GSAOnDevice``, with UCM's parameter names and meanings.

Budgets are in blocks of the engine's block size, except where UCM counts tokens (GSA on-device's
``hash_topk_tokens``, ``sink_token``, ``recent_token``): those stay tokens and are rounded *up* to
whole blocks at run time, so at least the tokens asked for are attended. KVStar's
``blk_repre_dim_prune_ratio`` keeps UCM's meaning (the share of channels *kept*).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ucm.config import ConfigError, StrictModel, parse_config
from ucm.sparse.options import ESAConfig, GSAConfig, GSAOnDeviceConfig, KVStarConfig, PSAConfig, StaticConfig

logger = logging.getLogger(__name__)

Algorithm = Literal["esa", "gsa", "gsa_ondevice", "kvstar", "psa", "static"]
OPTIONS: dict[str, type[StrictModel]] = {
    "esa": ESAConfig,
    "gsa": GSAConfig,
    "gsa_ondevice": GSAOnDeviceConfig,
    "kvstar": KVStarConfig,
    "psa": PSAConfig,
    "static": StaticConfig,
}


class SparseConfig(StrictModel):
    """Which algorithm decodes long requests, with its options (those of ``ucm.sparse``'s modules)."""

    algorithm: Algorithm = Field(
        description="The algorithm; its options go in the field of its name (its defaults where absent)"
    )
    min_tokens: int = Field(
        4096,
        ge=1,
        description="Shorter requests decode densely: below this length selection does not pay for itself "
        "(measured on 2 CPU cores with GSA at sparse_ratio 0.5, this threshold lowered to 512: 0.93x dense at "
        "2,000 tokens, 1.12x at 7,000)",
    )
    dense_layers: int = Field(2, ge=0, description="The first layers always attend every block")
    offload_blocks: int = Field(
        0,
        ge=0,
        description="Blocks of host memory (per worker, every layer) that hold decoding requests' middle "
        "blocks, off the paged KV cache: each attends them through a few blocks of the cache, refilled with "
        "what its selection keeps, so the cache holds more long requests (a dense layer reads them all "
        "where they lie). 0: off. Needs UCMConnector",
    )
    esa: ESAConfig | None = None
    gsa: GSAConfig | None = None
    gsa_ondevice: GSAOnDeviceConfig | None = None
    kvstar: KVStarConfig | None = None
    psa: PSAConfig | None = None
    static: StaticConfig | None = None

    @field_validator(*OPTIONS)
    @classmethod
    def _chosen_only(cls, value: Any, info: ValidationInfo) -> Any:
        chosen = info.data.get("algorithm")
        if value is not None and chosen is not None and info.field_name != chosen:
            raise ValueError(f"options of another algorithm (the chosen one is {chosen})")
        return value

    @model_validator(mode="after")
    def _servable(self) -> SparseConfig:
        options = self.options
        if self.offload_blocks and self.algorithm == "static":
            raise ValueError("offload_blocks: static keeps the most recent blocks; there is nothing to off-load")
        if options.windows(1)[1] < 1:
            raise ValueError(
                f"{self.algorithm}.local_window_sz: at least 1 when serving "
                "(the block being written is always attended)"
            )
        return self

    @property
    def options(self) -> Any:
        """The chosen algorithm's options (its defaults when none were given)."""
        return getattr(self, self.algorithm) or OPTIONS[self.algorithm]()


# UCM's names: algorithm sections, and per section the keys that are renamed or refused.
UCM_ALGORITHMS = {"ESA": "esa", "GSA": "gsa", "GSAOnDevice": "gsa_ondevice", "KVStarMultiStep": "kvstar"}
UCM_RENAMES = {
    "gsa": {"topk_ratio": "sparse_ratio", "init_window_size": "init_window_sz", "local_window_size": "local_window_sz"},
    "gsa_ondevice": {"topk_ratio": "sparse_ratio", "topk_tokens": "hash_topk_tokens"},
}
UCM_REFUSED = {
    "retrieval_workers": "retrieval runs on the decode step itself here; there is no worker pool to size",
    "retrieval_cache_size": "selections are kept per running request and dropped when it ends; nothing to size",
    "blk_repre_inner_token_merge": "block representations are per block (mean, extremes), not merged token groups",
}


def from_ucm(ucm: Mapping[str, Any], where: str = "ucm_sparse_config") -> dict[str, Any]:
    """UCM's ``ucm_sparse_config`` as our ``sparse`` section (a mapping, not yet validated). Beside
    UCM's algorithm sections it takes our ``min_tokens`` (UCM has no such threshold)."""
    if not isinstance(ucm, Mapping):
        raise ConfigError(f"{where}: expected a mapping such as {{ESA: {{...}}}}, got {type(ucm).__name__}")
    sections = {k: v for k, v in ucm.items() if k not in ("sparse_type", "min_tokens")}
    unknown = sorted(set(sections) - set(UCM_ALGORITHMS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown algorithm; UCM's names are {', '.join(UCM_ALGORITHMS)}")
    chosen = ucm.get("sparse_type")
    if chosen is None:
        if len(sections) != 1:
            raise ConfigError(f"{where}: give one algorithm section, or name one with sparse_type")
        chosen = next(iter(sections))
    if chosen not in UCM_ALGORITHMS:
        raise ConfigError(f"{where}.sparse_type: {chosen!r} is not one of {', '.join(UCM_ALGORITHMS)}")
    algorithm = UCM_ALGORITHMS[chosen]
    given = sections.get(chosen) or {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"{where}.{chosen}: expected a mapping of options")
    options: dict[str, Any] = {}
    renames = UCM_RENAMES.get(algorithm, {})
    for key, value in given.items():
        if key in UCM_REFUSED:
            raise ConfigError(f"{where}.{chosen}.{key}: not supported: {UCM_REFUSED[key]}")
        options[renames.get(key, key)] = value
    parse_config(OPTIONS[algorithm], options, f"{where}.{chosen}")  # errors name UCM's section
    translated = {"algorithm": algorithm, algorithm: options}
    if "min_tokens" in ucm:
        translated["min_tokens"] = ucm["min_tokens"]
    logger.info("ucm_sparse_config: %s read as sparse: %s", chosen, translated)
    return translated


def parse_sparse_config(data: Mapping[str, Any], where: str) -> SparseConfig:
    """Our shape, validated with errors under ``where``."""
    return parse_config(SparseConfig, data, where)
