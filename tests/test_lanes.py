"""``make test``'s two pytest lanes (:mod:`ucm_testing.lanes`), run on small projects of their own:
each lane runs its share, a failure in either fails the run, a module that starts an engine outside
the engines lane fails it, and a CI time limit's SIGTERM reaches each lane once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PYPROJECT = '[tool.pytest.ini_options]\nmarkers = ["engines: starts engines"]\n'
PLUGINS = "-p ucm_testing.timing -p ucm_testing.ci_report"  # as the repository's addopts load them


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; whoever adopted it has not reaped it yet


def project(tmp_path: Path, engines: str, beside: str) -> Path:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "test_engines.py").write_text("import pytest\npytestmark = pytest.mark.engines\n" + engines)
    (tmp_path / "test_beside.py").write_text(beside)
    return tmp_path


def lanes(root: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTEST_ADDOPTS": PLUGINS}
    env.pop("UCM_TEST_TIMING_RECORDING", None)  # this test's own run records; the lanes record theirs
    # In a process group of its own, as make's recipe is under CI's `timeout`.
    return subprocess.Popen(
        [sys.executable, "-m", "ucm_testing.lanes"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0,
    )


def test_each_lane_runs_its_share_and_the_beside_lanes_log_is_printed(tmp_path):
    root = project(tmp_path, "def test_e():\n    pass\n", "def test_b1():\n    pass\n\ndef test_b2():\n    pass\n")
    out, _ = lanes(root).communicate(timeout=120)
    assert "1 passed, 2 deselected" in out  # the engines lane
    assert "2 passed, 1 deselected" in out  # the beside lane, from its log
    assert "engines exited 0, beside exited 0" in out


def test_a_failure_in_the_beside_lane_fails_the_run(tmp_path):
    root = project(tmp_path, "def test_e():\n    pass\n", "def test_b():\n    assert False, 'beside broke'\n")
    proc = lanes(root)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "call failed: test_beside.py::test_b" in out and "beside broke" in out


@pytest.mark.engines  # its stand-in engine counts as one in the lane that runs this test too
def test_an_engine_started_in_the_beside_lane_fails_the_run(tmp_path):
    # A process titled as vLLM titles an engine core is what the timing plugin counts as an engine.
    beside = (
        "import subprocess\n\ndef test_b():\n    subprocess.run(['bash', '-c', 'exec -a VLLM::EngineCore sleep 1.5'])\n"
    )
    root = project(tmp_path, "def test_e():\n    pass\n", beside)
    proc = lanes(root)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "the beside lane started 1 vLLM engine(s) in test_beside.py: mark it `engines`" in out


def test_a_time_limits_sigterm_reaches_each_lane_once_and_both_print_their_summary(tmp_path):
    wait = "import pathlib, time\n\ndef test_{0}():\n    pathlib.Path('{0}.started').touch()\n    time.sleep(60)\n"
    # A test before it left SIGTERM at SIG_DFL, as an event loop that handled it does when it closes.
    reset = "import signal\n\ndef test_a():\n    signal.signal(signal.SIGTERM, signal.SIG_DFL)\n\n"
    root = project(tmp_path, wait.format("e"), reset + wait.format("b"))
    proc = lanes(root)
    deadline = time.monotonic() + 60
    while not ((root / "e.started").exists() and (root / "b.started").exists()):
        assert time.monotonic() < deadline, "the lanes did not start their tests"
        time.sleep(0.1)
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)  # as GNU timeout signals its group at the time limit
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - started < 30  # cut off, not waited out
    assert proc.returncode != 0
    assert out.count("KeyboardInterrupt: signal 15: the run was cut off !") == 2, out  # each lane's, once
    assert "engines exited 2, beside exited 2" in out  # pytest's code for an interrupted run


def test_lanes_end_when_the_runner_is_killed(tmp_path):
    wait = "import os, pathlib, time\n\ndef test_{0}():\n"
    wait += "    pathlib.Path('{0}.pid').write_text(str(os.getpid()))\n    time.sleep(60)\n"
    root = project(tmp_path, wait.format("e"), wait.format("b"))
    proc = lanes(root)
    deadline = time.monotonic() + 60
    while not ((root / "e.pid").exists() and (root / "b.pid").exists()):
        assert time.monotonic() < deadline, "the lanes did not start their tests"
        time.sleep(0.1)
    pids = [int((root / f"{lane}.pid").read_text()) for lane in ("e", "b")]
    proc.kill()  # SIGKILL, the runner alone: nothing is forwarded
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in pids):
        assert time.monotonic() < deadline, "a lane outlived its runner"
        time.sleep(0.1)
