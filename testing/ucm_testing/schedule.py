"""How ``make test`` spreads the suite over the machine's cores (pytest-xdist, ``-n``).

- A test module is one unit of work, kept whole on one worker, so its module-scoped engines start
  once. Modules that share session-scoped engines form one unit (``SHARED``); a module whose
  tests share nothing is split, a unit per test (``SPLIT``).
- Units are handed out longest first (their seconds in the last measured run,
  ``unit_costs.json``, written by ``scripts/test_timing.py``), so no long unit starts last and
  leaves a core idle at the end. A module not measured yet counts as long: it goes early.
- Memory is budgeted, by the scheduler in xdist's controller: a worker asking for work gets the
  first unit (longest first) whose peak fits beside the peaks of the units the other workers hold
  in the machine's memory less a reserve. A unit's peak is measured as above: the proportional set
  size its process tree grew by. While a large unit runs on one core, the other core works through
  the small ones; when nothing fits, the worker waits until a test ends elsewhere. (A gate in each
  worker, waiting for room before a unit's first test, was tried: a worker that waited held its
  core idle while the other ran its unit on one core, slower than no parallelism at all.)
- Each worker runs on a core of its own (its affinity, which the engines it starts keep to), so
  two workers' engines never spin their OpenMP threads on one core: measured, sharing both cores
  made the suite no faster than one process, and tensor-parallel ranks waited for a peer the other
  worker had descheduled (3x slower). On its own core a TP=2 engine's ranks take turns: 2x slower
  than on two idle cores, and nobody else's timing moves.
- Tests marked ``serial`` (wall-time deadlines: drains, rolls under load, the connector's
  deadlines; tensor-parallel engines, 2x faster on two idle cores than on one) run in a pytest
  run of their own after the parallel one, with nothing beside them and every core (the
  Makefile's ``test``).

xdist's own ``loadgroup`` would do the grouping from marks, but it renames items in a way pytest 9
no longer sees; a scheduler of ours groups by module path instead, in the controller, which never
imports the tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

COSTS = Path(__file__).with_name("unit_costs.json")
UNMEASURED = {"seconds": 300.0, "peak_gib": 4.0}
# Outside the units' peaks: the system and Docker (~1.5 GiB), two workers with torch imported
# (~2.2 GiB each), the session's plain vLLM (~2 GiB, e2e/conftest.py), and what sampling misses.
RESERVE_GIB = 9.0

# Modules that must run on one worker: they share a session fixture (e2e/conftest.py's plain vLLM).
SHARED = {
    module: "e2e-plain"
    for module in (
        "e2e/test_stack.py",
        "e2e/test_blend_stack.py",
        "e2e/test_mooncake_stack.py",
    )
}


# Modules whose tests share nothing (each starts what it needs): every test is a unit of its own.
SPLIT = {"tests/test_benchmarks.py"}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, the group its module shares fixtures with,
    or the test itself."""
    module = nodeid.split("::", 1)[0]
    return nodeid if module in SPLIT else SHARED.get(module, module)


class UnitScheduling(LoadScopeScheduling):
    """xdist's module-at-a-time scheduling with ``SHARED``'s modules as one scope, longest first
    (``pytest_collection_modifyitems`` below orders what the workers collect), and memory-aware: a
    worker wanting work gets the first unit that fits beside the units the other workers hold, so
    while a large unit runs the other core works through small ones instead of waiting."""

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # xdist's reorder is by test count, not by time
        self.measured = costs()
        self.budget_gib = memory_budget_gib()

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _held_elsewhere(self, node: object) -> float:
        """The measured peaks of the units the other workers hold, running or queued: a queued
        unit starts as soon as its worker is given any next test, so it counts already."""
        return sum(
            cost(scope, "peak_gib", self.measured)
            for other, work in self.assigned_work.items()
            if other is not node
            for scope, done in work.items()
            if not all(done.values())
        )

    def _assign_work_unit(self, node: object) -> None:
        held = self._held_elsewhere(node)
        peak = {scope: cost(scope, "peak_gib", self.measured) for scope in self.workqueue}
        unit = next((scope for scope in self.workqueue if held + peak[scope] <= self.budget_gib), None)
        if unit is None:
            if any(self._pending_of(work) > 1 for other, work in self.assigned_work.items() if other is not node):
                return  # another worker is running tests: asked again when it finishes one
            # Every other worker waits for work too (an xdist worker runs a test only once it has
            # the next, or is told to stop): the smallest unit lets a held-back test run and its
            # unit's memory go.
            unit = min(peak, key=peak.__getitem__)
        self.workqueue.move_to_end(unit, last=False)
        super()._assign_work_unit(node)

    def mark_test_complete(self, node: object, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        for other in self.nodes:  # what ended may make room for a worker that waits for work
            waits = self._pending_of(self.assigned_work.get(other, {})) <= 2
            if other is not node and waits and not other.shutting_down:
                self._reschedule(other)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "serial: timing-sensitive; runs after the parallel tests, alone")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> UnitScheduling:
    return UnitScheduling(config, log)


def memory_budget_gib() -> float:
    """What the units may hold together: the machine's memory less ``RESERVE_GIB``."""
    return int(Path("/proc/meminfo").read_text().split()[1]) / 2**20 - RESERVE_GIB


def costs() -> dict[str, dict[str, float]]:
    return json.loads(COSTS.read_text()) if COSTS.exists() else {}


# Memory a unit's process tree does not show: engines in containers are children of Docker's daemon.
UNSEEN_GIB = {"tests/images/test_runtime_image.py": 4.0}  # two engines, ~2 GiB each


def cost(unit: str, field: str, measured: dict[str, dict[str, float]]) -> float:
    value = measured.get(unit, UNMEASURED)[field]
    return value + UNSEEN_GIB.get(unit, 0.0) if field == "peak_gib" else value


def worker_input(config: pytest.Config) -> dict | None:
    """What xdist gave this worker; None in a pytest that is no worker (xdist's controller, a plain
    run, or a pytest a test starts, which inherits a worker's environment but not this)."""
    return getattr(config, "workerinput", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if worker_input(config) is None:
        return  # one process: the collected order stands
    measured = costs()
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(unit_of(item.nodeid), index)
    weight = {unit: cost(unit, "seconds", measured) for unit in first}
    items[:] = sorted(items, key=lambda item: (-weight[unit_of(item.nodeid)], first[unit_of(item.nodeid)]))


def pytest_sessionstart(session: pytest.Session) -> None:
    given = worker_input(session.config)
    if given is None:
        return
    worker = given["workerid"]
    workers = int(given["workercount"])
    cores = sorted(os.sched_getaffinity(0))
    if workers > 1:
        # A core of its own (the next worker the next): its engines, bound within it
        # (VLLMServer, ucm up), never spin their OpenMP threads against the other worker's.
        own = {cores[int(worker.removeprefix("gw")) % len(cores)]}
        for thread in os.listdir("/proc/self/task"):  # the mask is a thread's: every thread's
            os.sched_setaffinity(int(thread), own)
