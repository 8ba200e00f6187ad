"""A CPU engine's core process is forked from its API server instead of started afresh.

vLLM's CPU platform starts every process of an engine with ``spawn``: the engine core from the API
server, the worker from the engine core, each a new interpreter importing vLLM and PyTorch again
(~7 s of one core apiece). ``spawn`` is there for the worker: it computes on OpenMP threads whose
count and core binding libgomp reads from the environment once, when it loads, so the worker must
start with the binding its parent sets in its environment (``ompmultiprocessing``). The engine core
computes nothing on OpenMP threads (vLLM gives it one Torch thread): forking it from the API server,
as vLLM does on GPUs, costs a fork instead of an import. The worker keeps ``spawn`` and its
binding. One engine's start: 25 s → 18 s on the 2-core dev machine.

UCM's vLLM plugin installs this on vLLM's CPU platform; GPU engines keep vLLM's own choice.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext


def engine_core_context() -> BaseContext:
    """The context vLLM starts engine core processes (and their DP coordinator's queue) with."""
    return multiprocessing.get_context("fork")


def install() -> None:
    """On vLLM's CPU platform, engine cores started from now on are forked (see the module's doc)."""
    from vllm.platforms import current_platform
    from vllm.v1.engine import utils

    if current_platform.is_cpu():
        # Only the engine-core launcher's name: the workers' executor keeps vLLM's spawn.
        utils.get_mp_context = engine_core_context
