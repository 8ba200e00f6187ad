"""Stopping a child process the way every helper here does: SIGTERM, then SIGKILL after a grace."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from ucm_testing.zygote import Forked


def stop_process(proc: subprocess.Popen[bytes] | Forked, *, group: bool = False, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` (with ``group``, its whole process group), SIGKILL it after ``grace_s``."""
    if proc.poll() is not None:
        return

    def send(sig: signal.Signals) -> None:
        if group:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass  # the group is gone: its leader was reaped (by a zygote) with the rest of it
        else:
            proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


def spawn_pinned(args: list[str], cores: str, log: Path) -> subprocess.Popen[bytes]:
    """``args`` started on ``cores`` only (taskset), in a session of its own, output to ``log``."""
    return subprocess.Popen(
        ["taskset", "-c", cores, *args],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
