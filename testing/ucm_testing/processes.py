"""Stopping a child process the way every helper here does: SIGTERM, then SIGKILL after a grace."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process(proc: subprocess.Popen[bytes], *, group: bool = False, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` (with ``group``, its whole process group), SIGKILL it after ``grace_s``."""
    if proc.poll() is not None:
        return

    def send(sig: signal.Signals) -> None:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()
