"""The zygote that forks vLLM API servers for tests (:mod:`ucm_testing.zygote`): it forks only
launches whose environment it imported with, reports a server's exit as a parent would, and ends
with the process that started it. Served engines forked from it are every engine test's subject."""

from __future__ import annotations

import os

from ucm_testing.zygote import READ_AT_RUN, Zygote


def test_a_zygote_forks_what_it_can_reports_exits_and_ends_with_its_parent(tmp_path):
    zygote = Zygote()
    env = dict(os.environ)
    assert zygote.can_fork(env)
    assert zygote.can_fork({**env, "VLLM_CPU_OMP_THREADS_BIND": "1"})  # read when the engine runs
    assert "VLLM_CPU_OMP_THREADS_BIND" in READ_AT_RUN
    # prometheus_client chooses its multiprocess mode while importing: such a launch needs exec.
    assert not zygote.can_fork({**env, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert not zygote.can_fork({k: v for k, v in env.items() if k != "PATH"})

    log = tmp_path / "vllm.log"
    server = zygote.launch(["--max-num-seqs", "many"], env, log)
    assert server.wait(60) == 2  # vLLM's parser refuses it; the zygote reaped it and said how
    assert server.poll() == 2
    assert "--max-num-seqs: invalid" in log.read_text()

    zygote.close()
    assert zygote._proc.returncode == 0
    assert not zygote.can_fork(env)  # a closed zygote forks nothing
