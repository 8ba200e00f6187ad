"""The connector's staging pool: which buffers it hands out and which it keeps."""

import torch

from ucm.integration.vllm.staging import StagingPool
from ucm.store import Task

ROW = 1024  # bytes per row


def pool(keep_bytes: int) -> StagingPool:
    return StagingPool(lambda n: torch.empty((n, ROW), dtype=torch.uint8), keep_bytes)


def test_take_hands_out_the_smallest_free_buffer_that_fits_or_a_new_one():
    p = pool(1 << 20)
    small, large = torch.empty((4, ROW), dtype=torch.uint8), torch.empty((16, ROW), dtype=torch.uint8)
    p.give(large)
    p.give(small)
    assert p.take(3) is small
    assert p.take(3) is large  # the small one is out
    assert p.take(3).shape[0] == 3  # none is free: a new one
    assert p.take(0).shape[0] == 1


def test_give_keeps_the_largest_and_others_up_to_keep_bytes():
    p = pool(30 * ROW)
    for n in (3, 6, 20, 4):
        p.give(torch.empty((n, ROW), dtype=torch.uint8))
    assert [b.shape[0] for b in p._free] == [20, 6, 4]  # 30 rows in all: the 3-row one goes
    alone = pool(10 * ROW)
    for n in (6, 20):
        alone.give(torch.empty((n, ROW), dtype=torch.uint8))
    assert [b.shape[0] for b in alone._free] == [20]  # larger than keep_bytes, kept: it serves any transfer


def test_give_when_done_waits_for_every_task():
    p = pool(1 << 20)
    buf = torch.empty((2, ROW), dtype=torch.uint8)
    first, second = Task(1), Task(1)
    p.give_when_done(buf, [first, second])
    first._set([0], [True])
    assert p._free == []  # the other share's write still reads it
    second._set([0], [False])  # written or not, it is free once done
    assert p._free == [buf]
    later = torch.empty((3, ROW), dtype=torch.uint8)
    p.give_when_done(later, [])  # nothing in flight: back at once
    assert p._free[0] is later
