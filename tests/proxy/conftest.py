import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from ucm.config import parse_config
from ucm.deploy.ports import free_port
from ucm_proxy.app import create_app
from ucm_proxy.config import ProxyConfig
from ucm_proxy.server import uvicorn_config
from ucm_testing.fake_vllm import FakeVLLMThread


class RunningProxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.app = create_app(config)
        self.proxy = self.app.proxy
        self.server = uvicorn.Server(uvicorn_config(self.app, "warning"))
        self.url = f"http://127.0.0.1:{config.port}"
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "RunningProxy":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 10), **kw)


@pytest.fixture
def fakes() -> Iterator[FakeVLLMThread]:
    f = FakeVLLMThread()
    yield f
    f.close()


@pytest.fixture
def make_proxy():
    """make_proxy(prefill=[...], decode=[...], **options) -> a running proxy (stopped after the test)."""
    with contextlib.ExitStack() as stack:

        def make(**options) -> RunningProxy:
            options.setdefault("port", free_port())
            options.setdefault("health", {"interval_s": 0.2, "backoff_s": 0.2})
            # Tests count the requests fake engines get: the PD path check only where a test asks.
            options.setdefault("pd_check", {"interval_s": 0})
            # Fake engines' prompts are short: every request through prefill unless a test decides.
            options.setdefault("disaggregation", {"min_prefill_tokens": 0})
            config = parse_config(ProxyConfig, options, "proxy")
            return stack.enter_context(RunningProxy(config))

        yield make
