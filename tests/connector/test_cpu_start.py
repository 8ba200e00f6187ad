"""A CPU engine's processes as UCM's plugin starts them (:mod:`ucm.integration.vllm.cpu_start`):
the engine core forked from the API server, the worker started afresh with vLLM's OpenMP binding.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from ucm.integration.vllm import cpu_start
from ucm_testing.vllm_server import VLLMServer


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for task in tasks.iterdir() for c in (task / "children").read_text().split()]


def _named(pids: list[int], title: str) -> int:
    (pid,) = [p for p in pids if Path(f"/proc/{p}/cmdline").read_bytes().startswith(title.encode())]
    return pid


def _shared_dirty_bytes(pid: int) -> int:
    """Written pages this process shares with another: a fork's copy-on-write inheritance."""
    (line,) = [
        ln for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines() if ln.startswith("Shared_Dirty:")
    ]
    return int(line.split()[1]) * 1024


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e)


def test_install_forks_engine_cores_and_leaves_workers_to_vllms_spawn(monkeypatch):
    from vllm.v1.engine import utils
    from vllm.v1.executor import multiproc_executor

    monkeypatch.setattr(utils, "get_mp_context", utils.get_mp_context)  # undone after the test
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM's CPU platform sets
    cpu_start.install()
    cpu_start.install()  # vLLM may run plugins twice in a process: wrapped once
    assert not getattr(utils.get_mp_context.__wrapped__, "ucm_forking", False)
    assert utils.get_mp_context() is multiprocessing.get_context("fork")
    assert multiproc_executor.get_mp_context() is multiprocessing.get_context("spawn")
    # --numa-bind runs each child under numactl, which only a new process can be: vLLM's spawn.
    monkeypatch.setattr("sys.argv", ["vllm", "--numa-bind"])
    assert utils.get_mp_context() is multiprocessing.get_context("spawn")


def test_a_served_engine_core_is_forked_and_its_worker_keeps_the_binding(plain: VLLMServer):
    assert plain.complete("The binding holds", max_tokens=4)["choices"][0]["text"]  # threads exist
    api = plain.pid
    assert api is not None
    core = _named(_children(api), "VLLM::EngineCore")
    # A forked engine core shares the API server's imported interpreter, copy-on-write (~220 MiB
    # of written pages); a spawned one imports its own and shares no written page (72 KiB measured).
    assert _shared_dirty_bytes(core) > 64 * 2**20
    worker = _named(_children(core), "VLLM::Worker")
    binding = _environ(worker)["GOMP_CPU_AFFINITY"].split()
    assert _environ(worker)["OMP_NUM_THREADS"] == str(len(binding))
    pinned = {
        line.split(":", 1)[1].strip()
        for task in Path(f"/proc/{worker}/task").iterdir()
        if (task / "comm").read_text().strip() == "VLLM::Worker"
        for line in (task / "status").read_text().splitlines()
        if line.startswith("Cpus_allowed_list")
    }
    assert pinned == set(binding)  # one OpenMP thread on each core of the binding
