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
  the small ones. Where nothing fits (only large units left), the worker gets the smallest, and a
  gate in the worker (``MemoryGate``) holds that unit's first test until the ledger of running
  units' peaks has room. (The gate alone, without the scheduler choosing, left a waiting worker's
  core idle while the other ran its unit on one core: on CI, slower than no parallelism at all.)
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

import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
        return sum(
            largest_unfinished(work, self.measured) for other, work in self.assigned_work.items() if other is not node
        )

    def _assign_work_unit(self, node: object) -> None:
        busy = self._pending_of(self.assigned_work.get(node, {})) > 1
        unit = pick_unit(list(self.workqueue), self.measured, self._held_elsewhere(node), self.budget_gib, busy)
        if unit is None:
            return  # it has tests to run meanwhile; it asks again after each
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


def largest_unfinished(work: dict[str, dict[str, bool]], measured: dict[str, dict[str, float]]) -> float:
    """What a worker holds, from its assigned units (unit -> {test: done}): the largest peak among
    those not finished. A worker runs its units one after the other, and xdist queues the next
    before the current one's last test runs (a worker runs a test only once it has the next), so
    the running unit and the queued one never hold memory together."""
    return max((cost(unit, "peak_gib", measured) for unit, done in work.items() if not all(done.values())), default=0.0)


def pick_unit(
    queue: list[str], measured: dict[str, dict[str, float]], held: float, budget: float, busy: bool
) -> str | None:
    """The unit to hand a worker asking for work: the first (longest) of ``queue`` whose peak fits
    beside what the other workers ``held``. Where none fits: None while the worker is ``busy`` (it
    has tests to run, and asks again after each); otherwise the smallest, since its last test waits
    for a next one holding its unit's engines, and the worker's MemoryGate holds the unit's start
    until there is room."""
    fits = next((unit for unit in queue if held + cost(unit, "peak_gib", measured) <= budget), None)
    if fits is not None or busy:
        return fits
    return min(queue, key=lambda unit: cost(unit, "peak_gib", measured))


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


class MemoryBudget:
    """The workers' ledger of the peaks their running units may reach: one JSON file under a lock,
    named for the run. First come, first served: a worker waiting for room is not overtaken by
    one that just finished a unit and starts the next."""

    def __init__(self, run: str, worker: str) -> None:
        self.path = Path(tempfile.gettempdir()) / f"ucm-test-memory-{run}.json"
        self.worker = worker
        self.budget_gib = memory_budget_gib()

    @contextmanager
    def _ledger(self) -> Iterator[dict[str, dict[str, float]]]:
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            ledger = json.loads(self.path.read_text()) if self.path.exists() else {}
            ledger.setdefault("held", {})
            ledger.setdefault("waiting", {})  # worker: since when
            yield ledger
            self.path.write_text(json.dumps(ledger))

    def acquire(self, gib: float) -> None:
        while True:
            with self._ledger() as ledger:
                held, waiting = ledger["held"], ledger["waiting"]
                waiting.setdefault(self.worker, time.time())
                others = sum(v for k, v in held.items() if k != self.worker)
                first = min(waiting, key=waiting.__getitem__)
                if first == self.worker and (not others or others + gib <= self.budget_gib):
                    del waiting[self.worker]
                    held[self.worker] = gib
                    return
            time.sleep(0.5)

    def release(self) -> None:
        with self._ledger() as ledger:
            ledger["held"].pop(self.worker, None)

    def remove(self) -> None:
        for path in (self.path, self.path.with_suffix(".lock")):
            path.unlink(missing_ok=True)


class MemoryGate:
    """Holds a unit's measured peak in the ledger from its first test to its last: the scheduler
    hands out units that fit, and where it cannot (only large units left, a worker's last test
    waiting for a next), the unit waits here for room instead of overcommitting."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.measured = costs()
        self.unit: str | None = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        unit = unit_of(item.nodeid)
        if unit != self.unit:
            self.budget.acquire(cost(unit, "peak_gib", self.measured))
            self.unit = unit
        try:
            return (yield)
        finally:
            if nextitem is None or unit_of(nextitem.nodeid) != unit:
                self.budget.release()
                self.unit = None

    def pytest_sessionfinish(self) -> None:
        self.budget.release()
        if self.budget.worker == "gw0":
            self.budget.remove()


def pytest_sessionstart(session: pytest.Session) -> None:
    given = worker_input(session.config)
    if given is None:
        return
    worker = given["workerid"]
    session.config.pluginmanager.register(MemoryGate(MemoryBudget(given["testrunuid"], worker)), "ucm-memory-gate")
    workers = int(given["workercount"])
    cores = sorted(os.sched_getaffinity(0))
    if workers > 1:
        # A core of its own (the next worker the next): its engines, bound within it
        # (VLLMServer, ucm up), never spin their OpenMP threads against the other worker's.
        own = {cores[int(worker.removeprefix("gw")) % len(cores)]}
        for thread in os.listdir("/proc/self/task"):  # the mask is a thread's: every thread's
            os.sched_setaffinity(int(thread), own)
