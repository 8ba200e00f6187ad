"""A real vLLM OpenAI server (CPU build) as a subprocess on loopback, for tests and benchmarks."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ucm.deploy.local import cpu_list, usable_cpus
from ucm.deploy.ports import free_port
from ucm_testing.processes import stop_process
from ucm_testing.zygote import ENTRY, Forked, Zygote, import_env


class ServerFailed(RuntimeError):
    pass


_zygote_lock = threading.Lock()
_zygotes: dict[int, Zygote] = {}  # by the pid that started it: a forked child starts its own


def process_zygote() -> Zygote:
    """This process's zygote, started on first use and closed when the process exits."""
    with _zygote_lock:  # benchmarks start their arms' engines from threads
        if os.getpid() not in _zygotes:
            _zygotes[os.getpid()] = zygote = Zygote()
            atexit.register(zygote.close)
        return _zygotes[os.getpid()]


class VLLMServer:
    def __init__(
        self,
        model: str | Path,
        log_path: str | Path,
        *,
        kv_transfer_config: dict[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        kv_cache_gib: float = 0.25,
        threads_bind: str = "0-1",
        port: int | None = None,
    ) -> None:
        self.model = str(model)
        self.port = port or free_port()
        self.log_path = Path(log_path)
        args = [
            sys.executable,
            "-m",
            ENTRY,
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--block-size",
            "32",
            "--enforce-eager",
            "--max-model-len",
            "4096",
            "--enable-prompt-tokens-details",
            "--max-num-seqs",
            "16",
        ]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.args = [*args, *extra_args]
        # The tiny model's KV is 2 KiB a token: 256 MiB hold 128k tokens, twice what 16 sequences of
        # 4,096 can ask for. VLLM_CPU_KVCACHE_SPACE counts whole GiB (it would win over the flag):
        # 0.75 GiB more in every engine, which the suite's memory budget cannot spare.
        self.kv_cache_bytes = int(kv_cache_gib * 2**30)
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"},
            # Explicit binding: with the default (auto) vLLM may hold a core back and run 2x slower.
            "VLLM_CPU_OMP_THREADS_BIND": on_usable_cores(threads_bind),
            "GLOG_minloglevel": "2",
        }
        self._proc: subprocess.Popen[bytes] | Forked | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        """The API server's process (the engine's other processes are its descendants)."""
        return None if self._proc is None else self._proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VLLMServer:
        """Forked from this process's zygote when the environment allows (``ucm_testing.zygote``:
        the same server without its imports), else started with ``exec``."""
        args = [*self.args, "--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        # A zygote holds this process's environment: one started for a launch it cannot fork is waste.
        forkable = args[:3] == [sys.executable, "-m", ENTRY] and import_env(self.env) == import_env(os.environ)
        if forkable and (zygote := process_zygote()).can_fork(self.env):
            self._proc = zygote.launch(args[3:], self.env, self.log_path)
            return self
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        return self

    def wait_ready(self, timeout: float = 420.0) -> VLLMServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise ServerFailed(f"vLLM exited before it was ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerFailed(f"vLLM not ready after {timeout} s:\n{self.log_tail()}")

    def send_signal(self, sig: int) -> None:
        """To the server's main process only, as a kubelet signals a container."""
        assert self._proc is not None
        self._proc.send_signal(sig)

    def wait_exit(self, timeout: float = 240.0) -> int:
        assert self._proc is not None
        return self._proc.wait(timeout)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self._proc is not None:
            stop_process(self._proc, group=True, grace_s=30)
        if self._log is not None:
            self._log.close()

    # -- requests --------------------------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def complete(self, prompt: str, max_tokens: int = 16, **fields: Any) -> dict[str, Any]:
        """A greedy completion; returns vLLM's JSON response."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **fields}
        return self.post("/v1/completions", body)

    def metrics(self) -> dict[str, float]:
        return metric_totals(self.url)


def on_usable_cores(binding: str) -> str:
    """A binding written for cores 0, 1, … (``0-1``, ``0|1``) on the cores this process may use:
    core i is the i-th of them, wrapping (under ``taskset`` or a cpuset, an engine bound to a core
    it may not use would fail to start)."""
    cores = usable_cpus()

    def rank(part: str) -> str:
        wanted: set[int] = set()
        for item in part.split(","):
            first, _, last = item.partition("-")
            wanted.update(cores[i % len(cores)] for i in range(int(first), int(last or first) + 1))
        return cpu_list(sorted(wanted))

    return "|".join(rank(part) for part in binding.split("|"))


@contextmanager
def serving(*servers: VLLMServer) -> Iterator[None]:
    """These servers started at once and each ready (a start is mostly one core importing Python,
    so several start in about the time of one); all stopped on exit."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield
    finally:
        for server in servers:
            server.stop()


def metric_totals(url: str) -> dict[str, float]:
    """Prometheus samples at ``url``/metrics, summed over labels: {'name': value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def cached_tokens(response: dict[str, Any]) -> int:
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
