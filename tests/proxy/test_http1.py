"""The hot path's HTTP/1.1 client against scripted servers on real sockets: what it must get right
that aiohttp did (keep-alive, chunked streams, a stale kept-alive connection, failures mid-body,
silence, a client that stops reading)."""

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from ucm.deploy.ports import free_port
from ucm_proxy import http1
from ucm_proxy.http1 import Client, TooLarge, UpstreamError

LIMIT = 1 << 20  # what a whole body read may hold
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head, await reader.readexactly(length)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


class Server:
    """A TCP server whose connections run ``handler``; counts the connections it accepted."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> "Server":
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        head, body = await read_request(reader)
        writer.write(ok(body, b"X-Path: " + head.split(b" ")[1] + b"\r\n"))
        await writer.drain()


@pytest.mark.asyncio
async def test_requests_reuse_one_kept_alive_connection_and_carry_headers() -> None:
    async with Server(echo_forever) as server:
        client = Client({"Authorization": "Bearer k"})
        for i in range(3):
            resp = await client.post(server.url, "/v1/completions", b'{"n": %d}' % i, {"X-Request-Id": "r"}, 1.0)
            assert resp.status == 200
            assert resp.headers["content-type"] == "application/json"
            assert resp.headers["x-path"] == "/v1/completions"
            assert await resp.read(LIMIT) == b'{"n": %d}' % i
            resp.release()
        assert server.connections == 1
        client.close()


@pytest.mark.asyncio
async def test_a_url_prefix_is_kept() -> None:
    async with Server(echo_forever) as server:
        client = Client()
        resp = await client.post(server.url + "/base/", "/v1/completions", b"{}", {}, 1.0)
        assert resp.headers["x-path"] == "/base/v1/completions"
        resp.release()
        client.close()


@pytest.mark.asyncio
async def test_a_chunked_stream_arrives_as_it_is_sent() -> None:
    go_on = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"6\r\ndata 1\r\n")
        await writer.drain()
        await go_on.wait()
        writer.write(b"6\r\ndata 2\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with Server(stream) as server:
        client = Client()
        resp = await client.post(server.url, "/v1/completions", b"{}", {}, 1.0, idle_s=5.0)
        assert await resp.chunk() == b"data 1"
        assert not resp.at_eof()
        go_on.set()
        assert await resp.chunk() == b"data 2"
        assert await resp.chunk() == b""
        assert resp.at_eof()
        resp.release()
        client.close()


@pytest.mark.asyncio
async def test_a_kept_alive_connection_closed_by_the_backend_is_replaced_without_an_error() -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await read_request(reader)
        writer.write(ok(body))
        await writer.drain()
        # The request that follows on this connection is read, then the connection closes with no
        # answer: what a backend closing an idle connection looks like when the two cross.
        await reader.readuntil(b"\r\n\r\n")

    async with Server(one_then_close) as server:
        client = Client()
        for body in (b"first", b"second"):
            resp = await client.post(server.url, "/x", body, {}, 1.0)
            assert await resp.read(LIMIT) == body
            resp.release()
        assert server.connections == 2
        client.close()


@pytest.mark.asyncio
async def test_a_backend_closing_mid_body_is_an_upstream_error_and_the_connection_is_dropped() -> None:
    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()

    async with Server(half) as server:
        client = Client()
        resp = await client.post(server.url, "/x", b"{}", {}, 1.0)
        with pytest.raises(UpstreamError, match="closed the connection"):
            await resp.read(LIMIT)
        resp.release()
        client.close()


@pytest.mark.asyncio
async def test_silence_past_idle_s_is_a_timeout_before_and_after_the_headers() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await writer.drain()
        await reader.read()

    client = Client()
    async with Server(silent) as server:
        with pytest.raises(TimeoutError):
            await client.post(server.url, "/x", b"{}", {}, 1.0, idle_s=0.2)
    async with Server(stalls) as server:
        resp = await client.post(server.url, "/x", b"{}", {}, 1.0, idle_s=0.2)
        assert await resp.chunk() == b"hi"
        with pytest.raises(TimeoutError):
            await resp.chunk()
        resp.release()
    client.close()


@pytest.mark.asyncio
async def test_a_whole_body_past_the_limit_is_refused_and_its_connection_not_reused() -> None:
    """A backend cannot make the proxy hold more than it asked to read whole."""
    big = b"x" * (3 * http1.HIGH_WATER)

    async def huge_then_small(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(big))
        await writer.drain()

    async with Server(huge_then_small) as server:
        client = Client()
        resp = await client.post(server.url, "/x", b"{}", {}, 1.0)
        with pytest.raises(TooLarge):
            await resp.read(len(big) - 1)
        resp.release()
        again = await client.post(server.url, "/x", b"{}", {}, 1.0)
        assert await again.read(len(big)) == big  # exactly the limit is fine
        again.release()
        assert server.connections == 2  # the cut-off answer's connection was closed, not reused
        client.close()


@pytest.mark.asyncio
async def test_a_body_without_length_ends_with_the_connection() -> None:
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()

    async with Server(close_delimited) as server:
        client = Client()
        resp = await client.post(server.url, "/x", b"{}", {}, 1.0)
        assert await resp.read(LIMIT) == b"all of it"
        resp.release()
        client.close()


@pytest.mark.asyncio
async def test_releasing_an_unfinished_response_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await writer.drain()
        await reader.read()  # returns once the client closed
        closed.set()

    async with Server(endless) as server:
        client = Client()
        resp = await client.post(server.url, "/x", b"{}", {}, 1.0)
        assert await resp.chunk() == b"hi"
        resp.release()
        await asyncio.wait_for(closed.wait(), 2)
        client.close()


@pytest.mark.asyncio
async def test_a_reader_that_falls_behind_stops_the_backend_instead_of_buffering() -> None:
    sent = 0
    blocked = asyncio.Event()

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
        while sent < 64 * 1024 * 1024:
            writer.write(piece)
            sent += 65536
            try:
                await asyncio.wait_for(writer.drain(), 0.5)
            except TimeoutError:
                blocked.set()
                return

    async with Server(flood) as server:
        client = Client()
        resp = await client.post(server.url, "/x", b"{}", {}, 1.0)
        await asyncio.wait_for(blocked.wait(), 10)
        # The proxy holds about its high-water mark; the rest waits in the sockets' buffers.
        assert resp._size < http1.HIGH_WATER + 65536 * 2
        assert sent < 64 * 1024 * 1024
        resp.release()
        client.close()


@pytest.mark.asyncio
async def test_unreachable_and_malformed_backends_are_upstream_errors() -> None:
    client = Client()
    with pytest.raises(UpstreamError, match="cannot connect"):
        await client.post(f"http://127.0.0.1:{free_port()}", "/x", b"{}", {}, 1.0)

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with Server(garbage) as server:
        with pytest.raises(UpstreamError, match="malformed"):
            await client.post(server.url, "/x", b"{}", {}, 1.0)
    client.close()


@pytest.mark.asyncio
async def test_a_connection_idle_too_long_is_not_reused(monkeypatch) -> None:
    monkeypatch.setattr(http1, "MAX_IDLE_S", 0.05)
    async with Server(echo_forever) as server:
        client = Client()
        for pause in (0.0, 0.01, 0.2):
            await asyncio.sleep(pause)
            resp = await client.post(server.url, "/x", b"{}", {}, 1.0)
            assert await resp.read(LIMIT) == b"{}"
            resp.release()
        assert server.connections == 2  # the second request reused the first's; the third did not
        client.close()


def test_default_headers_cannot_smuggle_a_line() -> None:
    with pytest.raises(ValueError, match="line break"):
        Client({"Authorization": "Bearer k\r\nX-Admin: yes"})


@pytest.mark.asyncio
async def test_a_connection_paused_by_a_large_unread_answer_reads_again_when_reused() -> None:
    large = b"x" * (http1.HIGH_WATER * 2)

    async def large_then_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(large))
        await writer.drain()
        await echo_forever(reader, writer)

    async with Server(large_then_echo) as server:
        client = Client()
        resp = await client.post(server.url, "/x", b"{}", {}, 1.0)
        conn = resp._conn
        assert conn is not None
        while not resp._ended:  # all of it in, none of it read
            await asyncio.sleep(0.01)
            if conn.paused and not resp._ended:
                conn.drained()  # let the rest in; past the mark it pauses again
        assert conn.paused  # the last bytes came in past the mark
        resp.release()
        resp = await asyncio.wait_for(client.post(server.url, "/x", b"again", {}, 1.0), 2)
        assert await resp.read(LIMIT) == b"again"
        resp.release()
        assert server.connections == 1
        client.close()
