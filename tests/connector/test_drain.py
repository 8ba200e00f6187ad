"""An engine being stopped (SIGTERM, as a kubelet sends it) finishes what it has and refuses what
comes next with a 503 the proxy retries elsewhere. vLLM alone keeps its HTTP server open during the
drain and answers new requests with a 200 and no text (``finish_reason: abort``), which a client
takes for an answer."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from ucm.integration.vllm.health import MIDDLEWARE
from ucm_testing.vllm_server import VLLMServer

pytestmark = [pytest.mark.slow, pytest.mark.engines]


def post(url: str, body: dict) -> tuple[int, dict, dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_a_draining_engine_finishes_its_requests_and_refuses_new_ones(tiny_model, tmp_path):
    server = VLLMServer(
        tiny_model, tmp_path / "engine.log", extra_args=["--middleware", MIDDLEWARE, "--shutdown-timeout", "25"]
    ).start()
    try:
        server.wait_ready()
        url = server.url + "/v1/completions"
        long = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
        in_flight: list[tuple[int, dict, dict[str, str]]] = []
        thread = threading.Thread(target=lambda: in_flight.append(post(url, long)))
        thread.start()
        deadline = time.monotonic() + 30
        while server.metrics().get("vllm:num_requests_running", 0) < 1:
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.05)

        server.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the signal is handled on the server's event loop
        status, body, headers = post(url, {"model": server.model, "prompt": "Hello", "max_tokens": 4})
        assert (status, headers.get("retry-after")) == (503, "1"), body
        assert "shutting down" in body["error"]

        thread.join(60)
        status, body, _ = in_flight[0]
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 1500
        assert server.wait_exit(60) == 0
    finally:
        server.stop()
