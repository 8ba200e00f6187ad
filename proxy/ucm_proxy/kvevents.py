"""Following the engines' KV event streams (vLLM's ZMQ publisher) into the ``BlockIndex``.

vLLM publishes ``(topic, sequence number, msgpack batch)`` on a PUB socket and, when it has a
replay endpoint (a ROUTER), answers ``sequence number`` with every batch it still buffers from
there on, then an end marker. One task per engine subscribes. As soon as its connection is up, the
engine's entries are rebuilt from the replay buffer, so a proxy that restarts knows what the engines
hold at once, not only after their next event (live batches the replay already gave are skipped).
Whenever the stream cannot be trusted afterwards — the first batch after connecting to an engine
without a replay endpoint (what came before was missed), a sequence gap, a sequence that starts over
(the engine restarted), a batch that does not decode — the entries are cleared and rebuilt again.

A hostile or broken publisher cannot grow this proxy's memory past ``max_message_bytes`` per
message (ZMQ drops larger ones and the connection) and ``max_blocks_per_engine`` per engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ucm_proxy import metrics
from ucm_proxy.config import EventEndpoint, KVEventsConfig
from ucm_proxy.kvindex import BlockIndex, EventBatch, decode_batch

logger = logging.getLogger("ucm_proxy")

_END = -1  # vLLM's end-of-replay sequence number
REPLAY_TIMEOUT_S = 5.0
RECONNECT_S = 0.5


class Followers:
    """One following task per engine with a known publisher; kept in step with the pools' members."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.index = BlockIndex(config.max_blocks_per_engine)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._followers: dict[str, Follower] = {}
        self._ctx: zmq.asyncio.Context | None = None

    def connected(self, url: str) -> bool:
        """Whether ``url``'s stream is up and its replay (if any) was asked for and applied as far as
        it answered: what the engine publishes from now on reaches the index."""
        follower = self._followers.get(url)
        return follower is not None and follower.connected

    def follow(self, urls: Iterable[str]) -> None:
        """Follow exactly the engines at ``urls`` (call from the event loop)."""
        wanted = {u: e for u in dict.fromkeys(urls) if (e := self.config.endpoint(u)) is not None}
        for url in set(self._tasks) - set(wanted):
            self._tasks.pop(url).cancel()
            del self._followers[url]
            self.index.forget(url)
        if self._ctx is None and wanted:
            self._ctx = zmq.asyncio.Context()
        for url, endpoint in wanted.items():
            if url not in self._tasks:
                assert self._ctx is not None
                follower = self._followers[url] = Follower(self._ctx, self.index, url, endpoint, self.config)
                self._tasks[url] = asyncio.create_task(follower.run(), name=f"kv-events {url}")

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._followers.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None


class Follower:
    def __init__(
        self, ctx: zmq.asyncio.Context, index: BlockIndex, url: str, endpoint: EventEndpoint, config: KVEventsConfig
    ) -> None:
        self.ctx = ctx
        self.index = index
        self.url = url
        self.endpoint = endpoint
        self.config = config
        self.expected: int | None = None  # the next sequence number; None: resync on the next batch
        # After a replay on connecting: live batches below this were in the replay (the subscription
        # was up before the replay was asked for), not an engine that started over.
        self.replayed_below: int | None = None
        self.connected = False
        self._up = metrics.KV_EVENT_STREAM_UP.labels(url)  # a child: once the backend's series go, setting it is moot

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        return sock

    async def run(self) -> None:
        while True:
            await self._connection()
            await asyncio.sleep(RECONNECT_S)

    async def _connection(self) -> None:
        """Follow one connection until it drops: ZMQ redoes a dropped connection by itself, except one
        it dropped for an oversize message, so every drop makes a fresh socket here."""
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 10_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(self.endpoint.events)
        self.expected = self.replayed_below = None  # what was sent while no connection was up is unknown
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        return
                try:
                    if monitor in ready:
                        await self._connected()
                    else:
                        await self.receive(await sub.recv_multipart())
                except Exception:  # never let one engine's stream stop its following
                    logger.exception("KV events from %s", self.url)
                    self.expected = self.replayed_below = None
        finally:
            self.connected = False
            self._up.set(0)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _connected(self) -> None:
        """The subscription is up: rebuild from the replay now rather than at the next live batch."""
        if self.endpoint.replay is not None:
            metrics.child(metrics.KV_RESYNCS, "connect").inc()
            self.index.engine(self.url).clear()
            last = await self._replay(until=None)
            self.expected = self.replayed_below = None if last is None else last + 1
        self.connected = True
        self._up.set(1)

    async def receive(self, frames: list[bytes]) -> None:
        """One live message: resync first when the stream cannot be trusted, then apply it."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed()
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self.replayed_below is not None:
            if seq < self.replayed_below:
                return
            self.replayed_below = None
        if self.expected is None or seq != self.expected:
            reason = "start" if self.expected is None else ("restart" if seq < self.expected else "gap")
            metrics.child(metrics.KV_RESYNCS, reason).inc()
            self.index.engine(self.url).clear()
            if self.endpoint.replay is not None:
                await self._replay(until=seq)
        self.expected = seq + 1
        self._apply(frames[2])

    def _apply(self, payload: bytes) -> bool:
        """Apply one batch; False when it does not decode (the engine's entries are cleared)."""
        try:
            batch: EventBatch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._malformed()
            return False
        self.index.apply(self.url, batch)
        metrics.KV_EVENT_LAG.observe(max(0.0, time.time() - batch.ts))
        return True

    def _malformed(self) -> None:
        metrics.child(metrics.KV_EVENTS, "malformed").inc()
        metrics.child(metrics.KV_RESYNCS, "malformed").inc()
        self.index.engine(self.url).clear()
        self.expected = self.replayed_below = None

    async def _replay(self, until: int | None) -> int | None:
        """Apply the engine's buffered batches before ``until`` (the live one about to be applied; None:
        all of them); the last sequence number applied, None when none was."""
        assert self.endpoint.replay is not None
        sock = self._socket(zmq.DEALER)
        sock.connect(self.endpoint.replay)
        last = None
        try:
            await sock.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                    logger.warning("KV event replay from %s did not finish", self.endpoint.replay)
                    return None  # what it gave may have holes: the next live batch resyncs
                frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._malformed()
                    return None
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END:
                    return last
                if until is None or seq < until:
                    if not self._apply(frames[3]):
                        return None  # entries cleared: the next live batch resyncs
                    last = seq
        finally:
            sock.close(linger=0)
