"""Loopback ports: ``ucm up`` gives every role its own."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Collection
from pathlib import Path

# Below this the kernel never hands a port out on its own; vLLM, torch and Mooncake bind port 0
# for their internal sockets while engines start, so a port picked from the ephemeral range and
# bound half a minute later can be taken meanwhile (seen in CI: the proxy's "address in use").
LOWEST = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1", taken: Collection[int] = ()) -> int:
    """A free port outside the kernel's ephemeral range, so that it stays free until we bind it;
    none of ``taken`` (ports already promised to others but not yet bound)."""
    candidates = range(LOWEST, _ephemeral_low())
    for port in random.sample(candidates, min(len(candidates), 200)):
        if port not in taken and port_is_free(port, host):
            return port
    with socket.socket() as s:  # no room below the ephemeral range: any port
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False
