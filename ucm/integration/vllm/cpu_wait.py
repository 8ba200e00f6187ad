"""vLLM's processes on a CPU engine wait for each other's messages asleep, not spinning.

A worker waits for the scheduler's next step, and the engine core for the workers' results, on a
shared-memory queue (``vllm.distributed.device_communicators.shm_broadcast``, vLLM 0.32). After
each message a reader spins on the queue for ``busy_loop_s`` (1 s) before it sleeps on a ZeroMQ
socket the writer pings after each write. On a GPU machine the spin saves a wake-up per step; on a
CPU engine the spinning threads take the cores the model's own threads compute on, and every other
process's: an engine answering a request every 0.5 s burnt 1.2 cores doing nothing
(``benchmarks/cpu_wait.py``).

Spinning is also what hides a lost wake-up: the writer's socket keeps one unsent ping at most
(``SNDHWM`` 1), so a ping sent while the previous one is still queued is dropped, and a reader
that sleeps right after a message then waits for the next recheck (5 s) instead of the message
already written. With ``busy_loop_s`` 0 and vLLM's socket every request stalled 15 s.

:func:`install` makes readers sleep at once (``busy_loop_s`` 0) and binds the writer's socket with
room for :data:`PENDING_PINGS` pings, so none is dropped. The readers' sockets keep only the latest
ping (``CONFLATE``), so the room holds pings in flight, never a backlog. UCM's vLLM plugin installs
it in every process of an engine on vLLM's CPU platform; GPU engines keep vLLM's spin.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

PENDING_PINGS = 1024
UNBIND_WAIT_S = 1.0


def sleeping(init: Callable[..., None]) -> Callable[..., None]:
    """``SpinCondition.__init__`` with readers that never spin and a writer that drops no ping."""

    @functools.wraps(init)
    def __init__(self: Any, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = 1) -> None:
        import zmq

        init(self, is_reader, context, notify_address, 0.0 if is_reader else busy_loop_s)
        if not is_reader:
            # A high-water mark applies to the connections made after the bind: bind again with room.
            socket = self.local_notify_socket
            socket.unbind(notify_address)
            released(notify_address)
            socket.setsockopt(zmq.SNDHWM, PENDING_PINGS)
            socket.bind(notify_address)

    __init__.ucm_sleeping = True  # type: ignore[attr-defined]
    return __init__


def released(address: str) -> None:
    """Wait until an unbound ``ipc://`` endpoint's file is gone: ZeroMQ closes the old listener
    asynchronously, and its close would otherwise delete the file of the listener bound after it."""
    path = address.removeprefix("ipc://")
    if path == address or path.startswith("@"):
        return  # not a file: TCP, or Linux's abstract namespace
    deadline = time.monotonic() + UNBIND_WAIT_S
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.001)


def install() -> None:
    """On vLLM's CPU platform, every queue made from now on waits asleep (see the module's doc)."""
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.platforms import current_platform

    spin = shm_broadcast.SpinCondition
    if not current_platform.is_cpu() or getattr(spin.__init__, "ucm_sleeping", False):
        return  # a GPU keeps the spin; vLLM runs plugins once per process, maybe more
    spin.__init__ = sleeping(spin.__init__)  # type: ignore[method-assign]
