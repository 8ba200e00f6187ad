"""The zygote that forks vLLM API servers for tests (:mod:`ucm_testing.zygote`): it forks only
launches whose environment it imported with, reports a server's exit as a parent would, and ends
when closed; a server it forks starts as ``python -m`` would start it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from ucm_testing.vllm_server import VLLMServer, process_zygote
from ucm_testing.zygote import ENTRY, Forked, Zygote


def _signal_mask(pid: int, field: str) -> int:
    (line,) = [ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(field + ":")]
    return int(line.split()[1], 16)


def test_a_zygote_forks_what_it_can_reports_exits_and_ends_when_closed(tmp_path):
    zygote = Zygote()
    env = dict(os.environ)
    assert zygote.can_fork(env)
    assert zygote.can_fork({**env, "VLLM_CPU_OMP_THREADS_BIND": "1", "PYTEST_CURRENT_TEST": "x (call)"})
    # prometheus_client chooses its multiprocess mode while importing: such a launch needs exec.
    assert not zygote.can_fork({**env, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert not zygote.can_fork({k: v for k, v in env.items() if k != "PATH"})

    log = tmp_path / "vllm.log"
    server = zygote.launch(["--max-num-seqs", "many"], env, log)
    assert server.wait(60) == 2  # vLLM's parser refuses it; the zygote reaped it and said how
    assert server.poll() == 2
    assert "--max-num-seqs: invalid" in log.read_text()
    with pytest.raises(FileNotFoundError, match="no such directory for the server's log"):
        zygote.launch(["--help"], env, tmp_path / "gone" / "vllm.log")

    zygote.close()
    assert zygote._proc.returncode == 0
    assert not zygote.can_fork(env)  # a closed zygote forks nothing
    assert not zygote.socket_path.parent.exists()


def test_a_forked_server_starts_as_python_m_would(plain: VLLMServer, tiny_model, tmp_path):
    assert isinstance(plain._proc, Forked)
    assert os.getsid(plain.pid) == plain.pid  # a session of its own: stop_process kills its group
    pipe = 1 << (signal.SIGPIPE - 1)
    assert _signal_mask(plain.pid, "SigIgn") & pipe  # Python ignores SIGPIPE; a lost client is an error
    title = f"{sys.executable} -m {ENTRY} ".encode()  # what ps shows, as for python -m
    assert Path(f"/proc/{plain.pid}/cmdline").read_bytes().startswith(title)
    # A server made inside a test (pytest's PYTEST_CURRENT_TEST set) is forked too.
    assert process_zygote().can_fork(VLLMServer(tiny_model, tmp_path / "log").env)
