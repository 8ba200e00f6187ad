"""Stores by name: a registry of backends and the ``"cache|posix"`` pipeline syntax.

A store configuration is a mapping: ``spec`` names the stages front to back, and each stage's
options sit under its name::

    spec: cache|posix
    cache: {capacity: 4GiB}
    posix: {roots: [/mnt/kv]}

A stage in front of another is a tier: ``cache`` (DRAM) wraps the next stage itself; a file or
Mooncake store in front of another becomes the fast side of a :class:`TieredStore` (written
through, promoted on hit, dropped from it least recently used first by its own capacity), as in
UCM's ``Cache|Posix|Nfs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ucm.config import ConfigError, StrictModel, parse_config
from ucm.store.base import Store
from ucm.store.cache import CacheConfig, CacheStore
from ucm.store.empty import EmptyConfig, EmptyStore
from ucm.store.mooncake import MooncakeConfig, MooncakeStore
from ucm.store.posix import Ds3fsConfig, NfsConfig, PosixConfig, PosixStore
from ucm.store.tiered import TieredStore, tiered_posix


@dataclass(frozen=True)
class Backend:
    name: str
    config: type[StrictModel]
    # (validated config, the next stage or None) -> store
    build: Callable[[Any, Store | None], Store]
    is_tier: bool = False


REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    if backend.name in REGISTRY:
        raise ValueError(f"store backend {backend.name!r} is already registered")
    REGISTRY[backend.name] = backend


def _files(kind: str) -> Callable[[PosixConfig, Store | None], Store]:
    return lambda c, _n: tiered_posix(c, kind) if c.placement == "tiered" else PosixStore(c, kind)


register(Backend("posix", PosixConfig, _files("posix")))
register(Backend("nfs", NfsConfig, _files("nfs")))
register(Backend("ds3fs", Ds3fsConfig, _files("ds3fs")))
register(Backend("empty", EmptyConfig, lambda c, _n: EmptyStore()))
register(Backend("cache", CacheConfig, lambda c, n: CacheStore(c, n), is_tier=True))  # type: ignore[arg-type]
register(Backend("mooncake", MooncakeConfig, lambda c, _n: MooncakeStore(c)))


def parse_spec(spec: str) -> list[str]:
    stages = [s.strip() for s in spec.split("|")]
    names = ", ".join(sorted(REGISTRY))
    for s in stages:
        if s not in REGISTRY:
            raise ConfigError(f"store.spec: unknown store {s!r} in {spec!r}; known stores: {names}")
    if REGISTRY[stages[-1]].is_tier:
        raise ConfigError(f"store.spec: {stages[-1]!r} needs a store behind it (e.g. '{stages[-1]}|posix')")
    if len(set(stages)) != len(stages):
        raise ConfigError(f"store.spec: a store appears twice in {spec!r}")
    return stages


def validate_store_config(config: Mapping[str, Any]) -> list[tuple[str, StrictModel]]:
    """Check a store configuration without touching any storage; returns (stage, options) pairs."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"store: expected a mapping with 'spec' and per-stage options, got {type(config).__name__}")
    spec = config.get("spec")
    if not isinstance(spec, str) or not spec:
        raise ConfigError("store.spec: required, a store name or pipeline such as 'cache|posix'")
    stages = parse_spec(spec)
    for key in config:
        if key != "spec" and key not in stages:
            raise ConfigError(f"store.{key}: not a stage of {spec!r}; options go under one of {', '.join(stages)}")
    parsed = [(s, parse_config(REGISTRY[s].config, config.get(s), f"store.{s}")) for s in stages]
    for s, options in parsed[:-1]:
        if isinstance(options, PosixConfig) and options.capacity is None:
            raise ConfigError(
                f"store.{s}.capacity: required when {s} is in front of another store in {spec!r}: it is a fast "
                "tier, and its least recently used blocks are dropped from it above this (they stay behind it)"
            )
    return parsed


def create_store(config: Mapping[str, Any]) -> Store:
    """Build the store a configuration describes, back stage first."""
    stages = validate_store_config(config)
    store: Store | None = None
    built: list[Store] = []
    try:
        for name, options in reversed(stages):
            backend = REGISTRY[name]
            if store is not None and not backend.is_tier:
                store = TieredStore(backend.build(options, None), store)
            else:
                store = backend.build(options, store)
            built.append(store)
    except BaseException:
        if built:
            built[-1].close()  # a tier closes what is behind it
        raise
    assert store is not None
    return store
