"""The hot routes' HTTP front (``ucm_proxy.server``, ``ucm_proxy.exchange``) on raw sockets: what
an HTTP/1.1 client may do that httpx never does — pipelining, mixing routes on one connection,
``Expect: 100-continue``, ``Connection: close``, HTTP/1.0, leaving halfway through a body."""

import json
import socket
import time

import httptools
import pytest

from tests.proxy.test_proxy import sse_events
from ucm_testing.fake_vllm import MODEL, Behaviour

BODY = json.dumps({"model": MODEL, "prompt": "Hello there", "max_tokens": 3}).encode()


class Responses:
    """HTTP/1.1 responses parsed off one socket, in order."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[dict] = []
        self.current: dict = {}

    def on_message_begin(self) -> None:
        self.current = {"headers": {}, "body": b""}

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current["headers"][name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.current["status"] = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.current["body"] += body

    def on_message_complete(self) -> None:
        self.done.append(self.current)

    def read(self, sock: socket.socket, count: int, timeout: float = 10.0) -> list[dict]:
        """Until ``count`` responses are complete (or the server closes)."""
        sock.settimeout(timeout)
        while len(self.done) < count:
            data = sock.recv(65536)
            if not data:
                break
            self.parser.feed_data(data)
        return self.done


def post(path: str = "/v1/completions", body: bytes = BODY, extra: str = "", version: str = "1.1") -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: proxy\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body)}\r\n{extra}\r\n".encode() + body


@pytest.fixture
def proxy(fakes, make_proxy):
    p, d = fakes.add("p"), fakes.add("d")
    return make_proxy(prefill=[p.url], decode=[d.url])


def connect(proxy) -> socket.socket:
    host, port = proxy.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def text_of(response: dict) -> str:
    return json.loads(response["body"])["choices"][0]["text"]


def test_pipelined_requests_are_answered_in_order_mixing_routes(fakes, make_proxy):
    p, d = fakes.add("p"), fakes.add("d", Behaviour(chunk_delay_s=0.05))  # streams slower than whole answers
    proxy = make_proxy(prefill=[p.url], decode=[d.url])
    stream = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}).encode()
    with connect(proxy) as sock:
        sock.sendall(post(body=stream) + post() + b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n" + post())
        streamed, first, health, last = Responses().read(sock, 4)
    assert [r["status"] for r in (streamed, first, health, last)] == [200, 200, 200, 200]
    assert streamed["headers"]["transfer-encoding"] == "chunked"
    assert sse_events(streamed["body"].decode())[-1] == "[DONE]"
    assert text_of(first) == text_of(last) == " t0 t1 t2"
    assert json.loads(health["body"]) == {"status": "ok"}


def test_expect_100_continue_gets_its_interim_answer_before_the_body_is_sent(proxy):
    with connect(proxy) as sock:
        head, _, body = post(extra="Expect: 100-continue\r\n").partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\n\r\n")
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        [response] = Responses().read(sock, 1)
    assert response["status"] == 200 and text_of(response) == " t0 t1 t2"


def test_a_body_declared_too_large_is_refused_before_it_is_sent(fakes, make_proxy):
    p, d = fakes.add("p"), fakes.add("d")
    proxy = make_proxy(prefill=[p.url], decode=[d.url], max_body_bytes=1000)
    with connect(proxy) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n"
        sock.sendall(head)  # and never the body: the answer must not wait for it
        [response] = Responses().read(sock, 1, timeout=5)
    assert response["status"] == 413, response
    assert "larger than 1000 bytes" in json.loads(response["body"])["error"]["message"]
    assert d.requests == [] and p.requests == []


@pytest.mark.parametrize(
    ("status", "options"),
    [(401, {"api_keys": ["key"]}), (413, {"max_body_bytes": 1000}), (429, {"max_in_flight": 1})],
    ids=["unauthorized", "too-large", "busy"],
)
def test_an_answer_before_the_whole_body_closes_the_connection(fakes, make_proxy, status, options):
    """The rest of the body is never read: kept alive, the connection would take it (a client could
    trickle it for as long as it liked) and parse whatever followed as the next request."""
    proxy = make_proxy(prefill=[fakes.add("p").url], decode=[fakes.add("d").url], **options)
    if status == 429:
        proxy.app.in_flight = 1  # as if another request held the only place
    head = post(body=b"x" * 5000).partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
    with connect(proxy) as sock:
        sock.sendall(head + BODY[:20])  # 20 bytes of the 5000 declared, then nothing
        [response] = Responses().read(sock, 1, timeout=5)
        assert response["status"] == status, response
        assert response["headers"]["connection"] == "close"
        sock.settimeout(2)  # well before uvicorn's keep-alive timeout (5 s) would close it
        assert sock.recv(1024) == b""  # closed by the proxy, right after its answer
    proxy.app.in_flight = 0


@pytest.mark.parametrize(
    ("request_bytes", "why"),
    [
        (post(extra="Connection: close\r\n"), "the client asked"),
        (post(version="1.0"), "HTTP/1.0 without keep-alive"),
    ],
)
def test_a_connection_not_kept_alive_is_closed_after_its_answer(proxy, request_bytes, why):
    with connect(proxy) as sock:
        sock.sendall(request_bytes)
        [response] = Responses().read(sock, 1)
        assert response["status"] == 200, why
        assert response["headers"]["connection"] == "close"
        sock.settimeout(2)  # well before uvicorn's keep-alive timeout (5 s) would close it
        assert sock.recv(1024) == b"", why  # closed by the proxy, right after its answer


def test_a_query_string_does_not_leave_the_hot_route(proxy):
    with connect(proxy) as sock:
        sock.sendall(post(path="/v1/completions?trace=1") + post(path="/v1/%63ompletions"))
        responses = Responses().read(sock, 2)
    assert [(r["status"], text_of(r)) for r in responses] == [(200, " t0 t1 t2")] * 2


def test_a_client_leaving_halfway_through_its_body_costs_nothing(proxy):
    with connect(proxy) as sock:
        sock.sendall(post()[:-10])  # headers and most of the body
    time.sleep(0.3)
    assert proxy.app.in_flight == 0 and proxy.app.in_flight_bytes == 0
    backends = proxy.proxy.prefill.backends + proxy.proxy.decode.backends
    assert all(not b.in_flight for b in backends)
    with connect(proxy) as sock:  # and the proxy serves on
        sock.sendall(post())
        [response] = Responses().read(sock, 1)
    assert response["status"] == 200


def test_an_unexpected_error_is_a_500_and_the_connection_serves_on(proxy):
    calls = []
    handle = proxy.proxy.handle

    async def fails_once(exchange):
        calls.append(exchange.route)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return await handle(exchange)

    proxy.proxy.handle = fails_once
    with connect(proxy) as sock:
        sock.sendall(post() + post())
        broken, fine = Responses().read(sock, 2)
    assert broken["status"] == 500 and json.loads(broken["body"])["error"]["type"] == "internal_error"
    assert fine["status"] == 200 and text_of(fine) == " t0 t1 t2"


def test_a_stream_that_breaks_on_our_side_closes_the_connection(proxy, monkeypatch, caplog):
    """A bug mid-stream (not a backend failure, which becomes an SSE error event): the client sees
    the connection close before the stream's terminator, never a stream that looks complete."""
    import ucm_proxy.app

    async def breaks(upstream, resp, first):
        try:
            yield first, False
            raise RuntimeError("a bug")
        finally:
            upstream.release()

    monkeypatch.setattr(ucm_proxy.app, "relay_chunks", breaks)
    stream = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}).encode()
    with connect(proxy) as sock:
        sock.sendall(post(body=stream))
        sock.settimeout(2)
        received = b""
        while data := sock.recv(65536):
            received += data
    assert received.startswith(b"HTTP/1.1 200 OK") and b"data: " in received
    assert not received.endswith(b"0\r\n\r\n")
    assert "unexpected error answering /v1/completions" in caplog.text
    assert all(not b.in_flight for b in proxy.proxy.decode.backends)
