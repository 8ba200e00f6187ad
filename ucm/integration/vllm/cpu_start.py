"""A CPU engine's core process is forked from its API server instead of started afresh.

vLLM's CPU platform starts every process of an engine with ``spawn``: the engine core from the API
server, the worker from the engine core, each a new interpreter importing vLLM and PyTorch again
(~7 s of one core apiece). ``spawn`` is there for the worker: it computes on OpenMP threads whose
count and core binding libgomp reads from the environment once, when it loads (with the platform's
``LD_PRELOAD``), so the worker must start with the binding its parent puts in its environment
(``ompmultiprocessing``). The engine core computes nothing on OpenMP threads (vLLM gives it one
Torch thread): forking it from the API server, as vLLM does on GPUs, costs a fork instead of an
import, and its pages stay shared with the API server's. The worker keeps ``spawn`` and its binding.
One engine's start: 25 s → 18 s on the 2-core dev machine, ~250 MiB less memory.

Where vLLM itself would insist on ``spawn`` for reasons of its own (``--numa-bind`` wraps each child
in ``numactl``; a Ray actor), the engine core is spawned as before. UCM's vLLM plugin installs this
on vLLM's CPU platform; GPU engines keep vLLM's own choice. ``VLLM_PLUGINS`` naming no plugin turns
the plugin, and this, off.
"""

from __future__ import annotations

import functools
import multiprocessing
import sys
from collections.abc import Callable
from multiprocessing.context import BaseContext


def forking(get_mp_context: Callable[[], BaseContext]) -> Callable[[], BaseContext]:
    """vLLM's engine-core launcher's ``get_mp_context``, forking where vLLM would not need spawn."""

    @functools.wraps(get_mp_context)
    def engine_core_context() -> BaseContext:
        from vllm.ray.lazy_utils import is_in_ray_actor

        if "--numa-bind" in sys.argv or is_in_ray_actor():
            return get_mp_context()
        return multiprocessing.get_context("fork")

    engine_core_context.ucm_forking = True  # type: ignore[attr-defined]
    return engine_core_context


def install() -> None:
    """On vLLM's CPU platform, engine cores started from now on are forked (see the module's doc)."""
    from vllm.platforms import current_platform
    from vllm.v1.engine import utils

    if current_platform.is_cpu() and not getattr(utils.get_mp_context, "ucm_forking", False):
        # Only the engine-core launcher's name (and its multimodal tensor queue's): the workers'
        # executor and the DP coordinator keep vLLM's spawn.
        utils.get_mp_context = forking(utils.get_mp_context)
