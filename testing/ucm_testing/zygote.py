"""vLLM API servers forked from an interpreter that has imported vLLM once, for tests and benchmarks.

An engine start is mostly Python imports: the API server, then its worker, each import vLLM and
PyTorch (~7 s of one core apiece; the engine core is forked from the API server by UCM's plugin,
``ucm.integration.vllm.cpu_start``). A test run starts about a hundred engines. The zygote is a
process that imports vLLM's API server module once and then forks a server for each launch: the
server runs vLLM's own ``__main__`` with the launch's arguments, environment, working directory and
log, in a session of its own, as ``python -m`` would — only its imports are already done. Its
worker is still started afresh by vLLM (``spawn``), with its OpenMP binding.

What an interpreter reads from its environment while importing cannot change after the fork, so a
launch whose environment differs from the zygote's in any variable outside :data:`READ_AT_RUN` is
not forked: the caller starts it with ``exec`` instead (:meth:`Zygote.can_fork`).

A server starts as ``python -m`` would start it: in a session of its own (made before its pid is
handed back), with Python's signal dispositions (SIGPIPE ignored, SIGINT raising
KeyboardInterrupt), and it ends through the interpreter's own shutdown (exit handlers, vLLM's
finalizers stopping its engine core). The zygote reaps its servers and writes each one's exit
status next to its log, so the test that launched it waits for it as for a child (:class:`Forked`).
It runs in a session of its own too (Ctrl-C on a test run reaches the servers' tests, not it), and
exits when the process that started it closes its stdin (that process ended, or closed it).

    python -m ucm_testing.zygote SOCKET   # started by Zygote(), not by hand
"""

from __future__ import annotations

import json
import os
import runpy
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from setproctitle import getproctitle, setproctitle

ENTRY = "vllm.entrypoints.launchers.api_server.entry"
# Variables a launch may set differently and still be forked: vLLM reads them when it runs, never
# while importing; pytest sets PYTEST_CURRENT_TEST for each test phase and nothing imported reads it.
READ_AT_RUN = frozenset(
    {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "GLOG_minloglevel", "PYTEST_CURRENT_TEST"}
)
UNKNOWN_EXIT = 255  # a server's status when the zygote that would have reaped it is gone


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """What of an environment an interpreter may have read while importing vLLM."""
    return {k: v for k, v in env.items() if k not in READ_AT_RUN}


class Forked:
    """A server the zygote forked, waited for as ``subprocess.Popen`` waits for a child."""

    def __init__(self, pid: int, status: Path, args: list[str], zygote: subprocess.Popen[bytes]) -> None:
        self.pid, self.status, self.args, self._zygote = pid, status, args, zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.status.exists():
                self.returncode = int(self.status.read_text())
            elif self._zygote.poll() is not None and not Path(f"/proc/{self.pid}").exists():
                # Orphaned when the zygote died, then reaped by init: its status is lost.
                self.returncode = int(self.status.read_text()) if self.status.exists() else UNKNOWN_EXIT
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped, so the pid is still this server's
            os.kill(self.pid, sig)


class Zygote:
    """A zygote for this process's launches (see the module's doc); ``close()`` ends it."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self._dir = Path(tempfile.mkdtemp(prefix="ucm-zygote-"))
        self.socket_path = self._dir / "socket"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.socket_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            start_new_session=True,
        )
        assert self._proc.stdout is not None
        with self._proc.stdout:
            if self._proc.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"the vLLM zygote did not start (exit {self._proc.wait()})")

    def can_fork(self, env: Mapping[str, str]) -> bool:
        return self._proc.poll() is None and import_env(env) == import_env(self.env)

    def launch(self, args: list[str], env: Mapping[str, str], log: Path) -> Forked:
        """``python -m ENTRY *args``, forked; ``args`` are the arguments after the module's name."""
        if not log.parent.is_dir():  # where its exit status goes too: a lost status waits forever
            raise FileNotFoundError(f"{log.parent}: no such directory for the server's log")
        status = log.with_name(log.name + ".exit")
        status.unlink(missing_ok=True)
        request = {"args": args, "env": dict(env), "cwd": os.getcwd(), "log": str(log), "status": str(status)}
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(self.socket_path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            answer = conn.makefile().readline()
        if not answer.strip().isdigit():
            raise RuntimeError(f"the vLLM zygote could not launch {args}: {answer.strip() or 'no answer'}")
        return Forked(int(answer), status, [ENTRY, *args], self._proc)

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)


# -- the zygote process ---------------------------------------------------------------------------


def _become_server(request: dict[str, Any], in_session: int) -> NoReturn:
    """In the forked child: become ``python -m ENTRY *args``, then exit as that would (an exception
    printed and status 1, SystemExit's status, KeyboardInterrupt as SIGINT)."""
    try:
        os.setsid()
        os.write(in_session, b"1")  # the zygote hands our pid back only now: killpg finds the session
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 1024)  # the zygote's pipes are not the server's
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [ENTRY, *request["args"]]
        setproctitle(" ".join([sys.executable, "-m", *sys.argv]))  # what ps shows for python -m
        runpy.run_module(ENTRY, run_name="__main__", alter_sys=True)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def _reap(status_of: dict[int, str]) -> None:
    while status_of:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = Path(status_of.pop(pid))
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(str(os.waitstatus_to_exitcode(status)))
            tmp.rename(path)
        except OSError:
            pass  # its log's directory is gone: nobody waits for it any more


def _launch(conn: socket.socket, listener: socket.socket, status_of: dict[int, str]) -> None:
    request = json.loads(conn.makefile().readline())
    in_session, told = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(in_session)
        for sock in (conn, listener):  # closed, and their objects no longer own a descriptor number
            os.close(sock.detach())
        _become_server(request, told)  # leaves by SystemExit (or KeyboardInterrupt), past main's loop
    os.close(told)
    try:
        os.read(in_session, 1)  # empty if it died before its setsid: its status says why
    finally:
        os.close(in_session)
    status_of[pid] = request["status"]
    conn.sendall(f"{pid}\n".encode())


def main() -> None:
    # Everything the module imports, then forget the module itself: each server runs its body once,
    # as __main__, as ``python -m`` does (runpy would otherwise warn of a second copy).
    __import__(ENTRY)
    package, _, name = ENTRY.rpartition(".")
    del sys.modules[ENTRY]
    delattr(sys.modules[package], name)
    # setproctitle claims the memory of argv and the environment on its first use, which it cannot
    # do once a server has rewritten its environment: claim it here, so that vLLM's process titles
    # (VLLM::EngineCore, which the test timing counts engines by) show in the servers' processes.
    setproctitle(getproctitle())
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sys.argv[1])
    listener.listen(16)
    print("ready", flush=True)
    status_of: dict[int, str] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.2)
        _reap(status_of)
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            break  # the process that started the zygote is gone, or closed it
        if listener in readable:
            conn, _ = listener.accept()
            with conn:
                try:
                    _launch(conn, listener, status_of)
                except Exception as error:  # a bad request fails its launch, not the zygote
                    conn.sendall(f"{type(error).__name__}: {error}\n".encode())
    # Servers still running keep running (they belong to the tests that launched them). No exit
    # handlers: what vLLM's imports registered belongs to servers, not to the zygote.
    os._exit(0)


if __name__ == "__main__":
    main()
