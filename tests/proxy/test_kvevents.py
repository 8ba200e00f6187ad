"""Following engines' KV event streams: vLLM's own ZMQ publisher (its replay too), and a hand-driven
PUB socket for what a healthy publisher never sends (gaps, restarts, garbage, oversize messages)."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest
import pytest_asyncio
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from ucm.deploy.ports import free_port
from ucm.kv_events import ipc_event_endpoints
from ucm_proxy import metrics
from ucm_proxy.config import KVEventsConfig
from ucm_proxy.kvevents import Followers

BS = 4
URL = "http://127.0.0.1:1"
PROMPT = list(range(200, 232))  # 8 blocks


def vllm_stored(i: int) -> KVEventBatch:
    """Block i of PROMPT as vLLM announces it (its hash: any bytes, here b'h<i>')."""
    parent = None if i == 0 else f"h{i - 1}".encode()
    event = BlockStored(
        block_hashes=[f"h{i}".encode()],
        parent_block_hash=parent,
        token_ids=PROMPT[i * BS : (i + 1) * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return KVEventBatch(ts=time.time(), events=[event])


def held(followers: Followers) -> int:
    """PROMPT's blocks the engine's own cache holds, as the index has it."""
    return followers.index.cached([URL], PROMPT, None).get(URL, (0, 0))[0] // BS


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def resyncs(reason: str) -> float:
    return metrics.child(metrics.KV_RESYNCS, reason)._value.get()


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "ipc"])  # pods; ucm up (abstract sockets)
async def test_a_proxy_that_starts_late_rebuilds_from_vllms_replay_buffer(transport):
    if transport == "tcp":
        port, replay = free_port(), free_port()
        # As engines are configured: vLLM binds a wildcard endpoint (it connects to any other).
        bound = f"tcp://*:{port}", f"tcp://*:{replay}"
        followed = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
    else:
        bound = followed = ipc_event_endpoints(f"test-{os.getpid()}", free_port())
    publisher = ZmqEventPublisher(0, endpoint=bound[0], replay_endpoint=bound[1], topic="kv-events")
    followers = Followers(KVEventsConfig(endpoints={URL: {"events": followed[0], "replay": followed[1]}}))
    try:
        for i in range(5):  # before the proxy listens: only the replay has them
            publisher.publish(vllm_stored(i))
        await asyncio.sleep(0.3)
        followers.follow([URL])
        await until(lambda: held(followers) == 5)  # at once: no need to wait for the engine's next event
        await until(lambda: followers.connected(URL))
        publisher.publish(vllm_stored(5))
        await until(lambda: held(followers) == 6)
    finally:
        await followers.close()
        publisher.shutdown()


class HandPublisher:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.replay = self.ctx.socket(zmq.ROUTER)  # answered by hand, when a test says so
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")

    def send(self, seq: int, payload: bytes) -> None:
        self.sock.send_multipart([b"kv-events", seq.to_bytes(8, "big", signed=True), payload])

    def answer_replay(self, batches: dict[int, bytes]) -> None:
        """Wait for one replay request and answer it with ``batches``, then vLLM's end marker."""
        assert self.replay.poll(5000), "no replay was asked for"
        peer, _, _ = self.replay.recv_multipart()
        for seq, payload in batches.items():
            self.replay.send_multipart([peer, b"", b"kv-events", seq.to_bytes(8, "big", signed=True), payload])
        self.replay.send_multipart([peer, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.sock.close(0)
        self.replay.close(0)
        self.ctx.term()


def replaying(pub: HandPublisher) -> Followers:
    """Followers of ``pub``'s stream and its hand-answered replay, following it already."""
    endpoints = {URL: {"events": f"tcp://127.0.0.1:{pub.port}", "replay": f"tcp://127.0.0.1:{pub.replay_port}"}}
    followers = Followers(KVEventsConfig(endpoints=endpoints))
    followers.follow([URL])
    return followers


@pytest_asyncio.fixture
async def hand():
    pub = HandPublisher()
    followers = Followers(
        KVEventsConfig(endpoints={URL: {"events": f"tcp://127.0.0.1:{pub.port}"}}, max_message_bytes=1 << 16)
    )
    followers.follow([URL])
    # A PUB socket drops what it publishes before the subscriber has joined: send until one lands.
    deadline = time.monotonic() + 5
    while held(followers) == 0:
        assert time.monotonic() < deadline, "the follower never received"
        pub.send(0, msgspec.msgpack.encode(vllm_stored(0)))
        await asyncio.sleep(0.05)
    yield pub, followers
    await followers.close()
    pub.close()


def encoded(i: int) -> bytes:
    return msgspec.msgpack.encode(vllm_stored(i))


@pytest.mark.asyncio
async def test_a_lost_batch_clears_the_engines_entries(hand):
    pub, followers = hand
    seq = 1  # the fixture's batch was 0
    pub.send(seq, encoded(1))
    await until(lambda: held(followers) == 2)
    gaps = resyncs("gap")
    pub.send(seq + 2, encoded(2))  # seq + 1 never came: what it said (a removal?) is unknown
    await until(lambda: resyncs("gap") == gaps + 1)
    assert held(followers) == 0  # cleared; block 2's parent is not known any more: an orphan
    pub.send(seq + 3, encoded(0))
    await until(lambda: held(followers) == 1)  # and it builds up again from what comes


@pytest.mark.asyncio
async def test_a_restarted_engine_starts_over(hand):
    pub, followers = hand
    for seq in range(1, 4):
        pub.send(seq, encoded(seq))
    await until(lambda: held(followers) == 4)
    restarts = resyncs("restart")
    pub.send(0, encoded(0))  # its sequence starts over: its cache is empty but for this
    await until(lambda: resyncs("restart") == restarts + 1)
    assert held(followers) == 1


@pytest.mark.asyncio
async def test_garbage_and_oversize_messages_cannot_break_the_follower(hand):
    pub, followers = hand
    malformed = resyncs("malformed")
    pub.send(1, b"\x93not msgpack at all")
    await until(lambda: resyncs("malformed") == malformed + 1)
    assert held(followers) == 0
    pub.send(2, msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]))  # wrong types
    await until(lambda: resyncs("malformed") == malformed + 2)
    pub.sock.send_multipart([b"kv-events", b"short"])  # not (topic, seq, payload)
    await until(lambda: resyncs("malformed") == malformed + 3)
    huge = BlockStored(
        block_hashes=[b"x"] * 40_000,
        parent_block_hash=None,
        token_ids=[1] * 160_000,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    pub.send(3, msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[huge])))  # over max_message_bytes: dropped
    # The connection is redone; the follower goes on with what comes next.
    deadline = time.monotonic() + 10
    while held(followers) == 0:
        assert time.monotonic() < deadline, "the follower did not recover"
        pub.send(0, encoded(0))
        await asyncio.sleep(0.1)
    assert len(followers.index.engines[URL]) == 1


@pytest.mark.asyncio
async def test_following_stays_in_step_with_the_pools_members():
    followers = Followers(KVEventsConfig(port=5557, replay_port=5558))
    try:
        followers.follow(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        assert set(followers._tasks) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
        first = followers._tasks["http://10.0.0.1:8000"]
        followers.index.engine("http://10.0.0.2:8000")
        followers.follow(["http://10.0.0.1:8000", "http://10.0.0.3:8000"])  # discovery: one left, one came
        assert set(followers._tasks) == {"http://10.0.0.1:8000", "http://10.0.0.3:8000"}
        assert followers._tasks["http://10.0.0.1:8000"] is first  # a member that stays keeps its stream
        assert "http://10.0.0.2:8000" not in followers.index.engines  # what the one that left held is gone
    finally:
        await followers.close()


@pytest.mark.asyncio
async def test_live_batches_the_connect_replay_already_gave_are_not_a_restart():
    pub = HandPublisher()
    followers = replaying(pub)
    try:
        # The subscription is up when the follower asks for the replay; a batch published now
        # reaches it both live and in the replay.
        request = asyncio.to_thread(pub.replay.poll, 5000)
        assert await request, "no replay was asked for on connecting"
        await asyncio.sleep(0.3)  # the PUB side has taken the subscription
        pub.send(3, encoded(3))
        restarts = resyncs("restart")
        await asyncio.to_thread(pub.answer_replay, {i: encoded(i) for i in range(4)})
        await until(lambda: followers.connected(URL))
        pub.send(4, encoded(4))
        await until(lambda: held(followers) == 5)
        assert resyncs("restart") == restarts  # seq 3 came twice: once was enough
    finally:
        await followers.close()
        pub.close()


@pytest.mark.asyncio
async def test_a_replay_that_breaks_off_leaves_the_engine_to_resync():
    """A batch in the replay that does not decode: what came after it is not applied as if the
    replay were whole; the next live batch resyncs (and asks the replay again)."""
    pub = HandPublisher()
    followers = replaying(pub)
    try:
        await asyncio.to_thread(pub.answer_replay, {0: encoded(0), 1: b"\x93garbage", 2: encoded(1)})
        await until(lambda: followers.connected(URL))
        assert held(followers) == 0
        await asyncio.sleep(0.3)  # the PUB side has taken the subscription
        starts = resyncs("start")
        pub.send(3, encoded(0))
        await asyncio.to_thread(pub.answer_replay, {i: encoded(i) for i in range(3)})
        await until(lambda: held(followers) == 3)
        assert resyncs("start") == starts + 1
    finally:
        await followers.close()
        pub.close()
