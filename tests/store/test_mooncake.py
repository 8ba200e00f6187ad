"""Mooncake through a real mooncake_master on loopback."""

import numpy as np
import pytest

from ucm.deploy.ports import free_port
from ucm.store import StoreError, create_store
from ucm.store.mooncake import MooncakeStore

from .helpers import blocks


@pytest.fixture(scope="module")
def mc(mooncake_master):
    store = create_store(
        {
            "spec": "mooncake",
            "mooncake": mooncake_master.store_options(global_segment_size="256MiB", staging_size="1MiB"),
        }
    )
    yield store
    store.close()


def test_registered_buffers_are_used_in_place(mc: MooncakeStore):
    arena = np.random.randint(0, 255, size=(8, 64 << 10), dtype=np.uint8)
    out = np.zeros_like(arena)
    mc.register_buffer(arena)
    mc.register_buffer(out)
    mc._staging[:] = b"\xab" * mc._staging.nbytes  # a sentinel: staging must stay untouched
    ids = [np.random.bytes(32) for _ in range(8)]
    assert mc.wait(mc.dump(ids, list(arena)), 30) == [True] * 8
    assert mc.wait(mc.load(ids, list(out)), 30) == [True] * 8
    assert (out == arena).all()
    assert bytes(mc._staging) == b"\xab" * mc._staging.nbytes


def test_unregistered_buffers_go_through_staging_in_rounds(mc: MooncakeStore):
    ids, data = blocks(6, 400 << 10)  # 2.4 MiB through a 1 MiB staging area
    assert mc.wait(mc.dump(ids, data), 30) == [True] * 6
    bufs = [bytearray(400 << 10) for _ in ids]
    assert mc.wait(mc.load(ids, bufs), 30) == [True] * 6
    assert [bytes(b) for b in bufs] == data


def test_block_larger_than_staging_fails_alone(mc: MooncakeStore):
    ids, data = blocks(2, 1000)
    big_id, big = blocks(1, 2 << 20)
    assert mc.wait(mc.dump([ids[0], big_id[0], ids[1]], [data[0], big[0], data[1]]), 30) == [True, False, True]


def test_unreachable_master_is_a_clear_error():
    port = free_port()
    with pytest.raises(StoreError, match=r"mooncake: cannot join the store \(master_address='127.0.0.1:\d+'"):
        create_store(
            {
                "spec": "mooncake",
                "mooncake": {
                    "master_address": f"127.0.0.1:{port}",
                    "metadata_server": f"http://127.0.0.1:{port}/metadata",
                    "global_segment_size": "16MiB",
                    "local_buffer_size": "16MiB",
                    "staging_size": "1MiB",
                },
            }
        )
