"""Each store kind (``ucm.deploy.stores``): its options, the connector config and volumes it gives
on each site, claims, extra roles, how status describes it, what ``ucm up`` ignores."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from itertools import count
from pathlib import Path

import pytest
from pydantic import ValidationError

from ucm.deploy.plan import KV_CONFIG_FILE, build_plan
from ucm.deploy.roles import PlanError, Site
from ucm.deploy.spec import UCMDeploymentSpec
from ucm.deploy.stores import KINDS
from ucm.integration.vllm.config import parse_connector_config
from ucm.store import create_store
from ucm.store.factory import REGISTRY
from ucm.store.posix import TRAILER

K8S = Site("kubernetes", namespace="serving")
MODEL = {"source": {"hostPath": "/models/tiny"}}
STORES = {
    "posix": {"type": "posix", "pvc": {"claimName": "kv"}},
    "nfs": {"type": "nfs", "nfs": {"server": "10.0.0.2", "path": "/kv"}},
    "ds3fs": {"type": "ds3fs", "ds3fs": {"mountPath": "/mnt/3fs"}},
    "mooncake": {"type": "mooncake", "mooncake": {"master": {}}},
}


def local_site(tmp_path) -> Site:
    ports = count(20000)
    given: dict[str, int] = {}
    return Site(
        "local",
        config_dir=str(tmp_path),
        kv_dir=str(tmp_path / "kv"),
        ports=lambda role: given.setdefault(role, next(ports)),
    )


def plan(store: dict, site: Site = K8S):
    return build_plan("demo", UCMDeploymentSpec.model_validate({"model": MODEL, "store": store}), site)


def store_config(p) -> dict:
    extra = json.loads(p.files[KV_CONFIG_FILE])["kv_connector_extra_config"]
    parse_connector_config(extra)  # what the engines will accept
    return extra["store"]


def test_every_kind_has_an_example_here_and_a_store_backend():
    assert set(STORES) == set(KINDS)
    for kind in KINDS.values():
        assert kind.name in REGISTRY  # the connector stage it configures exists


@pytest.mark.parametrize(
    ("kind", "root", "volume"),
    [
        ("posix", "/var/lib/ucm/kv", {"persistentVolumeClaim": {"claimName": "kv"}}),
        ("nfs", "/var/lib/ucm/kv", {"nfs": {"server": "10.0.0.2", "path": "/kv"}}),
        ("ds3fs", "/var/lib/ucm/kv", {"hostPath": {"path": "/mnt/3fs", "type": "Directory"}}),
    ],
)
def test_file_kinds_mount_one_kv_volume_in_engine_pods(kind, root, volume):
    p = plan(STORES[kind])
    assert store_config(p) == {"spec": kind, kind: {"roots": [root]}}
    for name in ("prefill", "decode"):
        (kv,) = [v for v in p.role(name).volumes if v.name == "kv"]
        assert kv.mount_path == root and kv.source == volume and not kv.read_only
    assert not [v for v in p.role("proxy").volumes if v.name == "kv"]


@pytest.mark.parametrize(("kind", "root"), [("posix", "kv"), ("nfs", "kv"), ("ds3fs", "/mnt/3fs")])
def test_file_kinds_locally_use_paths_of_this_machine(kind, root, tmp_path):
    p = plan(STORES[kind], local_site(tmp_path))
    expected = str(tmp_path / root) if root == "kv" else root
    assert store_config(p)[kind]["roots"] == [expected]
    assert all(not r.volumes for r in p.roles)


def test_mooncake_runs_its_master_and_points_engines_at_it(tmp_path):
    p = plan(STORES["mooncake"])
    mc = store_config(p)["mooncake"]
    assert mc["master_address"] == "demo-mooncake-master:50051"
    assert mc["metadata_server"] == "http://demo-mooncake-master:8080/metadata"
    assert mc["local_hostname"] == "${POD_IP}" and mc["global_segment_size"] == 4 << 30
    master = p.role("mooncake-master")
    assert [x.number for x in master.ports] == [50051, 8080, 9003]

    local = plan(STORES["mooncake"], local_site(tmp_path))
    mc = store_config(local)["mooncake"]
    ports = {x.name: x.number for x in local.role("mooncake-master").ports}
    assert mc["master_address"] == f"127.0.0.1:{ports['rpc']}"  # the master listens where engines look
    assert mc["metadata_server"] == f"http://127.0.0.1:{ports['metadata']}/metadata"


def test_an_external_mooncake_runs_nothing():
    store = {"type": "mooncake", "mooncake": {"address": "mc:50051", "metadataServer": "http://mc:8080/metadata"}}
    p = plan(store)
    assert [r.component for r in p.roles] == ["prefill", "decode", "proxy"]
    assert store_config(p)["mooncake"]["master_address"] == "mc:50051"
    assert p.store_external == "external master mc:50051"


@pytest.mark.parametrize(
    ("mooncake", "message"),
    [
        ({}, "store.mooncake: set exactly one of master"),
        ({"master": {}, "address": "m:1"}, "store.mooncake: set exactly one of master"),
        ({"address": "m:1"}, "store.mooncake.metadataServer: required"),
        ({"master": {}, "segmentSize": "4Gb"}, "store.mooncake.segmentSize"),
    ],
)
def test_mooncake_specs_that_cannot_work_name_the_field(mooncake, message):
    with pytest.raises(PlanError) as err:
        plan({"type": "mooncake", "mooncake": mooncake})
    assert str(err.value).startswith(message)


def test_posix_claims_what_it_creates_and_describes_what_it_borrows():
    created = plan({"type": "posix", "pvc": {"create": {"size": "2Ti", "storageClassName": "cephfs"}}})
    assert created.store_claim == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "2Ti"}},
        "storageClassName": "cephfs",
    }
    assert created.role("decode").volumes[-1].source == {"persistentVolumeClaim": {"claimName": "demo-kv"}}
    with pytest.raises(PlanError, match=r"^store.pvc.create.size"):
        plan({"type": "posix", "pvc": {"create": {"size": "2TB"}}})
    borrowed = plan(STORES["posix"])
    assert borrowed.store_claim is None and borrowed.store_external == "claim kv"


@pytest.mark.parametrize(
    ("kind", "external"),
    [("nfs", "NFS 10.0.0.2:/kv"), ("ds3fs", "3FS mount /mnt/3fs"), ("mooncake", None)],
)
def test_status_describes_stores_nothing_here_watches(kind, external):
    assert plan(STORES[kind]).store_external == external


@pytest.mark.parametrize(
    ("store", "ignored"),
    [
        (STORES["posix"], ["store.pvc (blocks go to the run directory)"]),
        (STORES["nfs"], ["store.nfs (blocks go to the run directory)"]),
        (STORES["ds3fs"], []),
        ({"type": "mooncake", "mooncake": {"master": {"image": "mc:1"}}}, ["store.mooncake.master.image"]),
    ],
)
def test_kubernetes_only_options(store, ignored):
    spec = UCMDeploymentSpec.model_validate({"model": MODEL, "store": store})
    assert spec.store.kind.kubernetes_only(spec.store.options) == ignored


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_kind_without_its_options_names_the_field(kind):
    field = KINDS[kind].field
    with pytest.raises(ValidationError, match=rf"store.{field}: required when type is {kind}"):
        UCMDeploymentSpec.model_validate({"model": MODEL, "store": {"type": kind}})


def _engine_writes(store_config: dict, block: int, count: int) -> None:
    """What an engine's workers do to the store: build it from the plan's config and dump blocks."""
    store = create_store(store_config)
    for _ in range(count):
        ids = [os.urandom(32) for _ in range(4)]
        assert store.wait(store.dump(ids, [os.urandom(block) for _ in ids])) == [True] * 4
    store.close()


def stored_bytes(root: Path) -> int:
    total = 0
    for path in root.rglob("*"):
        try:
            if len(path.name) == 64 and path.is_file():
                total += path.stat().st_size
        except FileNotFoundError:
            pass  # evicted since it was listed
    return total


def test_several_engines_on_one_volume_stay_under_the_resources_capacity_and_still_hit(tmp_path):
    """store.files.capacity in the resource reaches every engine's store through the plan; the
    engines share the write budget between capacity checks (each marks itself in .ucm-writers),
    so together they stay under it."""
    block = 16 << 10
    # The blocks in flight (4 engines x 2 I/O threads) fit in the room above the high watermark,
    # as they do many times over at real capacities.
    capacity = 300 * (block + TRAILER.size)
    files = {"capacity": str(capacity), "ioThreads": 2}
    spec = UCMDeploymentSpec.model_validate({"model": MODEL, "store": {**STORES["posix"], "files": files}})
    store_config = json.loads(build_plan("d", spec, local_site(tmp_path)).files[KV_CONFIG_FILE])[
        "kv_connector_extra_config"
    ]["store"]
    assert store_config["posix"]["capacity"] == capacity
    kv = tmp_path / "kv"
    kv.mkdir()
    spawn = mp.get_context("spawn")
    engines = [spawn.Process(target=_engine_writes, args=(store_config, block, 60)) for _ in range(4)]
    for e in engines:
        e.start()
    peak = 0
    while any(e.is_alive() for e in engines):
        peak = max(peak, stored_bytes(kv))
        time.sleep(0.002)
    assert [e.exitcode for e in engines] == [0] * 4
    assert 4 * 60 * 4 * block > 3 * capacity  # they wrote well past capacity ...
    assert 0 < peak <= capacity  # ... and the store never held more
    store = create_store(store_config)
    ids = [os.urandom(32) for _ in range(8)]
    assert store.wait(store.dump(ids, [os.urandom(block) for _ in ids])) == [True] * 8
    assert store.lookup(ids) == [True] * 8  # the latest blocks serve hits
    store.close()
