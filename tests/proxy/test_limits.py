"""The proxy against slow and greedy clients (issue 34, H1 and M1), on raw sockets: a request head
that grows or never ends, uploads that hold the body budget and send nothing, and a few hundred of
them at once while another client is served."""

import asyncio
import contextlib
import json
import socket
import statistics
import time
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY

from tests.proxy.test_exchange import BODY, Responses, connect, post
from ucm.config import ConfigError, parse_config
from ucm_proxy.config import ProxyConfig
from ucm_proxy.server import client_key

pytestmark = pytest.mark.engines  # times things tightly: make test runs it alone (ucm_testing.lanes)

# Loopback is all of 127/8 on Linux: "other" clients connect from their own address, the one the
# proxy's per-client share is keyed by.
OTHER = "127.0.0.2"
CHUNKED_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("ucm_proxy_rejected_requests_total", {"reason": reason}) or 0.0


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def connect_from(proxy, address: str) -> socket.socket:
    host, port = proxy.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10, source_address=(address, 0))


def refused_and_closed(sock: socket.socket, status: int) -> dict:
    [response] = Responses().read(sock, 1, timeout=5)
    assert response["status"] == status, response
    assert response["headers"]["connection"] == "close"
    sock.settimeout(2)
    assert sock.recv(1024) == b""  # closed right after the answer
    return response


# -- H1: request heads ---------------------------------------------------------------------------


def test_a_header_that_keeps_growing_is_refused_431_at_the_cap(fakes, make_proxy):
    """One header line sent a piece at a time: httptools re-copies the value on every piece, so the
    cost grew with the square of its length for as long as the client kept sending."""
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], timeouts={"header_s": 30})
    before = rejected("header_bytes")
    with connect(proxy) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\nX-Grow: ")
        started = time.monotonic()
        try:
            for _ in range(100):  # 100 KiB: past the 64 KiB cap
                sock.sendall(b"a" * 1024)
                time.sleep(0.002)  # separate reads, as a trickling client's would be
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed before the client stopped
        response = refused_and_closed(sock, 431)
    assert json.loads(response["body"])["error"]["code"] == 431
    assert time.monotonic() - started < 10  # at the cap, not at the header deadline
    assert rejected("header_bytes") == before + 1


@pytest.mark.parametrize(
    ("head", "reason"),
    [
        (b"GET /health HTTP/1.1\r\nHost: proxy\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n", "header_bytes"),
        (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", "header_count"),
        (post(extra="X-Big: " + "a" * (64 << 10) + "\r\n"), "header_bytes"),  # a hot route, body behind
    ],
    ids=["bytes", "count", "bytes-hot-route"],
)
def test_a_head_over_the_limits_sent_at_once_is_refused_431(fakes, make_proxy, head, reason):
    d = fakes.add("d")
    proxy = make_proxy(mode="mixed", decode=[d.url])
    before = rejected(reason)
    with connect(proxy) as sock:
        sock.sendall(head)
        refused_and_closed(sock, 431)
    assert rejected(reason) == before + 1
    assert d.requests == []


def test_heads_within_the_limits_are_served_whatever_the_reads(fakes, make_proxy):
    """The cap counts a head's bytes only: a body in the same read as its head (cut where the head's
    room ends), and requests pipelined behind it, are parsed as before."""
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], max_header_bytes=1024, max_header_count=16)
    body = json.dumps({"model": "fake-model", "prompt": "x" * 5000, "max_tokens": 2}).encode()
    many = b"GET /health HTTP/1.1\r\nHost: proxy\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(15)) + b"\r\n"
    with connect(proxy) as sock:
        sock.sendall(post(body=body) + post(body=body) + many + post())
        answers = Responses().read(sock, 4)
    assert [a["status"] for a in answers] == [200, 200, 200, 200], answers


def test_a_trailer_that_keeps_growing_is_refused_431_at_the_cap(fakes, make_proxy):
    """Trailers after a chunked body's last chunk are parsed like headers, at the same cost (worse:
    1 MiB sent in 1 KiB pieces took httptools 2 s), and the body's deadline bounds only their time."""
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], timeouts={"body_s": 30})
    before = rejected("header_bytes")
    with connect(proxy) as sock:
        sock.sendall(CHUNKED_HEAD + b"%x\r\n%b\r\n0\r\nX-Grow: " % (len(BODY), BODY))
        started = time.monotonic()
        try:
            for _ in range(100):
                sock.sendall(b"a" * 1024)
                time.sleep(0.002)
        except (BrokenPipeError, ConnectionResetError):
            pass
        refused_and_closed(sock, 431)
    assert time.monotonic() - started < 10
    assert rejected("header_bytes") == before + 1


def test_chunks_larger_than_the_head_room_are_a_body(fakes, make_proxy):
    """After a chunk's size line the room is for trailers, until its data starts: data in a later
    read, larger than that room, is parsed as the body it is."""
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], max_header_bytes=1024)
    body = json.dumps({"model": "fake-model", "prompt": "x" * 5000, "max_tokens": 2}).encode()
    with connect(proxy) as sock:
        sock.sendall(CHUNKED_HEAD + b"%x\r\n" % len(body))
        time.sleep(0.2)  # the size line in one read, the data in the next
        sock.sendall(body + b"\r\n0\r\nX-Checksum: 1\r\n\r\n")
        [answer] = Responses().read(sock, 1)
    assert answer["status"] == 200, answer


def test_a_head_that_never_ends_is_cut_off_408_and_counted(fakes, make_proxy):
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], timeouts={"header_s": 0.5})
    before = rejected("header_timeout")
    with connect(proxy) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        refused_and_closed(sock, 408)
    assert rejected("header_timeout") == before + 1


def test_header_limits_are_validated_naming_the_field():
    base = {"mode": "mixed", "decode": ["http://d:1"]}
    with pytest.raises(ConfigError, match="max_header_bytes: Input should be greater than or equal to 1024"):
        parse_config(ProxyConfig, {**base, "max_header_bytes": 100}, "proxy")
    with pytest.raises(ConfigError, match="max_header_count: Input should be greater than or equal to 16"):
        parse_config(ProxyConfig, {**base, "max_header_count": 3}, "proxy")
    with pytest.raises(ConfigError, match=r"timeouts\.header_s: Input should be greater than 0"):
        parse_config(ProxyConfig, {**base, "timeouts": {"header_s": 0}}, "proxy")


# -- M1: the body budget --------------------------------------------------------------------------


def test_idle_uploads_hold_nothing_and_lock_nobody_out(fakes, make_proxy):
    """16 chunked uploads that send nothing reserved the whole 64 MiB (4 MiB each) for body_s:
    everyone else got 429 (from one address, and after a per-client share, from 16 addresses:
    benchmarks/proxy_attack.py). A request now holds the bytes that arrived: these hold one each."""
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], timeouts={"body_s": 2})
    app = proxy.app
    uploads = [connect_from(proxy, OTHER) for _ in range(16)]
    try:
        for sock in uploads:
            sock.sendall(CHUNKED_HEAD + b"1\r\n{\r\n")  # one byte of the body, then nothing
        wait_for(lambda: app.in_flight == 16)
        assert app.in_flight_bytes == 16 and app.client_bytes == {OTHER: 16}
        with connect(proxy) as sock:  # another client
            sock.sendall(post())
            [answer] = Responses().read(sock, 1)
        assert answer["status"] == 200, answer
        for sock in uploads:
            refused_and_closed(sock, 408)  # the body deadline
        assert app.in_flight_bytes == 0 and app.client_bytes == {}
    finally:
        for sock in uploads:
            sock.close()


def test_a_client_sending_past_its_share_is_refused_as_the_bytes_arrive(fakes, make_proxy):
    """What a client's uploads hold is what they sent: one that would take it past its share is
    refused (429, closed) as the bytes come in; other clients are served."""
    limits = {"max_body_bytes": 1 << 20, "max_in_flight_bytes": 4 << 20, "max_client_bytes": 2 << 20}
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], timeouts={"body_s": 2}, **limits)
    app, before = proxy.app, rejected("client_bytes")
    chunk = b"%x\r\n" % (900 << 10) + b" " * (900 << 10) + b"\r\n"  # JSON allows leading spaces
    uploads = [connect_from(proxy, OTHER) for _ in range(3)]
    try:
        for sock in uploads[:2]:
            sock.sendall(CHUNKED_HEAD + chunk)
        wait_for(lambda: app.client_bytes.get(OTHER) == 2 * (900 << 10))
        uploads[2].sendall(CHUNKED_HEAD + chunk)
        [response] = Responses().read(uploads[2], 1, timeout=5)
        assert response["status"] == 429 and response["headers"]["connection"] == "close", response
        uploads[2].settimeout(2)
        with contextlib.suppress(ConnectionResetError):  # closed with our unread bytes: a reset, or EOF
            assert uploads[2].recv(1024) == b""
        assert rejected("client_bytes") == before + 1
        with connect(proxy) as sock:  # another client
            sock.sendall(post())
            [answer] = Responses().read(sock, 1)
        assert answer["status"] == 200, answer
        for sock in uploads[:2]:
            refused_and_closed(sock, 408)
        assert app.in_flight_bytes == 0 and app.client_bytes == {}
    finally:
        for sock in uploads:
            sock.close()


def test_the_client_share_is_validated_naming_the_field():
    base = {"mode": "mixed", "decode": ["http://d:1"]}
    assert parse_config(ProxyConfig, base, "proxy").client_bytes == 16 << 20  # a quarter of the budget
    small = {**base, "max_in_flight_bytes": 6 << 20}
    assert parse_config(ProxyConfig, small, "proxy").client_bytes == 4 << 20  # never below one body
    with pytest.raises(ConfigError, match="max_client_bytes: 1000 is below max_body_bytes"):
        parse_config(ProxyConfig, {**base, "max_client_bytes": 1000}, "proxy")
    with pytest.raises(ConfigError, match="max_client_bytes: 134217728 is above max_in_flight_bytes"):
        parse_config(ProxyConfig, {**base, "max_client_bytes": 128 << 20}, "proxy")


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),  # one host's /64 is one client
        ("::ffff:10.1.2.3", "10.1.2.3"),
    ],
)
def test_clients_are_told_apart_by_address_and_ipv6_by_their_64(host, key):
    assert client_key(host) == key


# -- both, by the hundred --------------------------------------------------------------------------


async def _exchange(sock_writes: Callable, address: str, port: int) -> tuple[int | None, float]:
    """Open a connection from ``address``, let ``sock_writes`` send on it, and read the one answer:
    its status (None if closed without one) and when it came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))
    responses = Responses()
    sender = asyncio.create_task(sock_writes(writer))
    try:
        while not responses.done:
            data = await reader.read(65536)
            if not data:
                break
            responses.parser.feed_data(data)
        return (responses.done[0]["status"] if responses.done else None), time.monotonic()
    finally:
        sender.cancel()
        writer.close()


def test_hundreds_of_slow_clients_do_not_stall_others(fakes, make_proxy):
    """200 slow-header connections (half growing one header, half silent after a partial head) and
    200 idle chunked uploads, all from one address, while another client sends requests one after
    another: it is served throughout, promptly, and every slow connection is answered and closed."""
    proxy = make_proxy(mode="mixed", decode=[fakes.add("d").url], timeouts={"header_s": 4, "body_s": 3})
    port = int(proxy.url.rsplit(":", 1)[1])

    async def growing(writer: asyncio.StreamWriter) -> None:
        writer.write(b"GET /health HTTP/1.1\r\nHost: proxy\r\nX-Grow: ")
        while True:  # 8 KiB each 50 ms: 64 KiB in ~0.4 s, well before the 4 s deadline
            await asyncio.sleep(0.05)
            writer.write(b"a" * 8192)

    async def silent(writer: asyncio.StreamWriter) -> None:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-")

    async def idle_upload(writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + b"1\r\n{\r\n")

    async def normal(until: float) -> list[float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        latencies = []
        try:
            while time.monotonic() < until:
                sent = time.monotonic()
                writer.write(post())
                responses = Responses()
                while not responses.done:
                    data = await reader.read(65536)
                    assert data, "the proxy closed a normal client's connection"
                    responses.parser.feed_data(data)
                assert responses.done[0]["status"] == 200, responses.done[0]
                latencies.append(time.monotonic() - sent)
                await asyncio.sleep(0.01)
        finally:
            writer.close()
        return latencies

    async def attack() -> tuple[list[float], list[float], list, list, list]:
        idle = await normal(time.monotonic() + 1.0)
        started = time.monotonic()
        slow = [
            *(asyncio.create_task(_exchange(growing, OTHER, port)) for _ in range(100)),
            *(asyncio.create_task(_exchange(silent, OTHER, port)) for _ in range(100)),
            *(asyncio.create_task(_exchange(idle_upload, OTHER, port)) for _ in range(200)),
        ]
        busy = await normal(started + 5.0)  # past both deadlines: the slow ones all answered by then
        done = await asyncio.wait_for(asyncio.gather(*slow), 10)
        offsets = [(status, at - started) for status, at in done]
        return idle, busy, offsets[:100], offsets[100:200], offsets[200:]

    idle, busy, grew, stalled, uploads = asyncio.run(attack())
    assert all(status == 431 for status, _ in grew), grew
    assert all(status == 408 and 3.5 < at < 8 for status, at in stalled), stalled
    assert all(status == 408 for status, _ in uploads), uploads  # they held nothing: cut off at the deadline
    # Liveness and a loose bound (a shared, noisy machine): the attack costs the other client a few
    # times its idle latency at worst, not the seconds the slow clients hold their connections.
    assert len(busy) > 20
    p99 = statistics.quantiles(busy, n=100)[98]
    assert p99 < 1.0, f"p99 {p99 * 1000:.1f} ms under attack, p50 {statistics.median(idle) * 1000:.1f} ms idle"
    assert proxy.app.in_flight_bytes == 0 and proxy.app.client_bytes == {}
