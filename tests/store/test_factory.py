"""Stores by name, pipelines, and configuration errors that name the field."""

import pytest

from ucm.config import ConfigError
from ucm.store import REGISTRY, create_store, validate_store_config
from ucm.store.cache import CacheStore
from ucm.store.posix import PosixStore


def test_registry_has_every_backend():
    assert {"posix", "nfs", "ds3fs", "cache", "mooncake", "empty"} <= set(REGISTRY)


def test_pipeline_composes_front_to_back(tmp_path):
    store = create_store({"spec": "cache|posix", "cache": {"capacity": "1MiB"}, "posix": {"roots": [str(tmp_path)]}})
    assert isinstance(store, CacheStore) and isinstance(store.next, PosixStore)
    assert store.config.capacity == 1 << 20
    store.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"spec": "s3"}, r"store\.spec: unknown store 's3'.*known stores: cache, ds3fs, empty"),
        (
            {"spec": "posix|nfs", "posix": {"roots": ["/x"]}, "nfs": {"roots": ["/y"]}},
            r"store\.posix\.capacity: required when posix is in front of another store",
        ),
        (
            {"spec": "nfs", "nfs": {"roots": ["/x"], "placement": "tiered"}},
            r"store\.nfs: placement tiered needs at least two roots",
        ),
        ({"spec": "nfs", "nfs": {"roots": ["/x"], "fast_capacity": 10}}, r"fast_capacity is for placement tiered"),
        ({"spec": "nfs", "nfs": {"roots": ["/x"], "placement": "striped"}}, r"store\.nfs\.placement: Input should be"),
        ({"spec": "cache"}, r"store\.spec: 'cache' needs a store behind it"),
        ({"spec": "cache|cache|posix"}, "appears twice"),
        ({}, r"store\.spec: required"),
        ({"spec": "posix", "posix": {}}, r"store\.posix\.roots: Field required"),
        ({"spec": "posix", "posix": {"roots": []}}, r"store\.posix\.roots: List should have at least 1 item"),
        ({"spec": "posix", "posix": {"roots": ["/x"], "io_thread": 2}}, r"store\.posix\.io_thread: unknown field"),
        ({"spec": "posix", "posix": {"roots": ["/x"], "io_threads": "many"}}, r"store\.posix\.io_threads: .*integer"),
        ({"spec": "posix", "posix": {"roots": ["/x"], "io_threads": 0}}, r"store\.posix\.io_threads: .*greater than"),
        ({"spec": "posix", "posix": {"roots": ["/x"], "capacity": "lots"}}, r"store\.posix\.capacity"),
        ({"spec": "posix", "posix": "/x"}, r"store\.posix: expected a mapping"),
        ({"spec": "posix", "cache": {}}, r"store\.cache: not a stage of 'posix'"),
        ({"spec": "cache|empty", "cache": {"capacity": 1, "write_mode": "later"}}, r"store\.cache\.write_mode"),
        (
            {"spec": "mooncake", "mooncake": {"master_address": "nohost", "metadata_server": "x"}},
            r"store\.mooncake\.master_address: .*host:port",
        ),
        ({"spec": "mooncake", "mooncake": {"master_address": "h:1"}}, r"store\.mooncake\.metadata_server: Field"),
    ],
)
def test_bad_configs_name_the_field(config, message):
    with pytest.raises(ConfigError, match=message):
        validate_store_config(config)


def test_byte_sizes_accept_units():
    (_, cache), _ = validate_store_config({"spec": "cache|empty", "cache": {"capacity": "2GiB"}})
    assert cache.capacity == 2 << 30


def test_failure_in_a_front_stage_closes_the_stages_behind(tmp_path, monkeypatch):
    closed = []
    monkeypatch.setattr(PosixStore, "close", lambda self: closed.append(self))

    def broken(config, nxt):
        raise RuntimeError("tier failed")

    from ucm.store import factory

    monkeypatch.setitem(factory.REGISTRY, "cache", factory.Backend("cache", REGISTRY["cache"].config, broken, True))
    with pytest.raises(RuntimeError):
        create_store({"spec": "cache|posix", "cache": {"capacity": 10}, "posix": {"roots": [str(tmp_path)]}})
    assert len(closed) == 1
