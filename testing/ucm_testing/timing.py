"""A pytest plugin that records where a run's time goes, per unit (a test module; each test of
``tests/test_benchmarks.py``, whose tests share nothing): wall seconds, CPU seconds of the test
process and everything it started, vLLM engines started, the peak memory of that process tree;
and for the run, the machine's peak memory in use.

The pytest process writes ``timing-<pid>.json`` into
``$UCM_TEST_TIMING_DIR`` (default ``build/test-timing`` under the rootdir); ``scripts/test_timing.py``
merges them into the table of ``docs/development.md``.

CPU is read from ``/proc``: a thread samples the process tree every half second and credits each
process with the CPU it had last been seen with, so a process that lives under half a second (a
short ``helm`` or ``kubectl``) and a process's last half second are not counted; engines and
servers are. An engine is a vLLM ``EngineCore`` process (its process title), so a TP=2 engine counts
once and an engine inside a container (which is not our descendant) not at all.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

SAMPLE_S = 0.5
SPLIT = {"tests/test_benchmarks.py"}  # modules whose tests share nothing: a unit per test


def unit_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return nodeid if module in SPLIT else module


TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class UnitTiming:
    tests: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    engines: int = 0
    # Proportional set size (shared pages split among their sharers) above what the process tree
    # held when the unit began: pytest itself and the session's fixtures are not the unit's.
    peak_gib: float = 0.0


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS


def _all_stats() -> dict[int, tuple[int, float]]:
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(entry)) is not None:
            stats[int(entry)] = stat
    return stats


def _descendants(stats: dict[int, tuple[int, float]], root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _) in stats.items():
        children[ppid].append(pid)
    tree, todo = [], list(children[root])
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children[pid])
    return tree


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root`` and its live descendants (an engine's processes)."""
    stats = _all_stats()
    return sum(stats[pid][1] for pid in [root, *_descendants(stats, root)] if pid in stats)


def _pss(pid: int) -> int:
    """A process's proportional set size in bytes: its share of each page it maps, so the sum over
    processes is what they hold together (resident sizes count torch's libraries once per engine
    process: four times the truth for a suite of engines)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass  # it ended meanwhile
    return 0


def _is_engine(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")
    except OSError:
        return False


def _machine_used_bytes() -> int:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024


class ProcessTree:
    """The CPU seconds this process and its descendants have used, their memory, and the
    engines among them, from samples of ``/proc``."""

    def __init__(self) -> None:
        self.root = os.getpid()
        self.last_cpu: dict[int, float] = {}  # every descendant ever seen: its CPU when last seen
        self.engines_seen: set[int] = set()
        self.peak = 0  # bytes, since the last take_peak()
        self.held = 0  # bytes, at the last sample
        self.machine_peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucm-test-timing", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        stats = _all_stats()
        tree = _descendants(stats, self.root)
        with self._lock:
            for pid in tree:
                self.last_cpu[pid] = stats[pid][1]
                if pid not in self.engines_seen and _is_engine(pid):
                    self.engines_seen.add(pid)
            self.held = sum(_pss(pid) for pid in [self.root, *tree])
            self.peak = max(self.peak, self.held)
            self.machine_peak = max(self.machine_peak, _machine_used_bytes())

    def cpu_s(self) -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        with self._lock:
            return usage.ru_utime + usage.ru_stime + sum(self.last_cpu.values())

    def take_peak(self) -> int:
        with self._lock:
            peak, self.peak = self.peak, 0
            return peak

    def engines(self) -> int:
        with self._lock:
            return len(self.engines_seen)


class TimingPlugin:
    def __init__(self, out: Path, lane: str) -> None:
        self.out = out
        self.lane = lane
        self.tree = ProcessTree()
        self.units: dict[str, UnitTiming] = defaultdict(UnitTiming)
        self._current: tuple[str, float, float, int] | None = None
        self._unit_base: tuple[str, int] = ("", 0)  # the unit running, and the tree's PSS at its start
        self.started = time.time()

    def pytest_sessionstart(self) -> None:
        self.tree.start()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.tree.sample()
        self.tree.take_peak()
        unit = unit_of(nodeid)
        if self._unit_base[0] != unit:
            self._unit_base = (unit, self.tree.held)
        self._current = (unit, time.monotonic(), self.tree.cpu_s(), self.tree.engines())

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        if self._current is None:
            return
        self.tree.sample()
        unit, wall0, cpu0, engines0 = self._current
        timing = self.units[unit]
        timing.tests += 1
        timing.wall_s += time.monotonic() - wall0
        timing.cpu_s += self.tree.cpu_s() - cpu0
        timing.engines += self.tree.engines() - engines0
        timing.peak_gib = max(timing.peak_gib, (self.tree.take_peak() - self._unit_base[1]) / 2**30)
        self._current = None

    def pytest_sessionfinish(self) -> None:
        self.tree.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        record = {
            "started": self.started,
            "wall_s": time.time() - self.started,
            "machine_peak_gib": self.tree.machine_peak / 2**30,
            "cores": os.cpu_count(),
            "lane": self.lane,
            "units": {name: asdict(timing) for name, timing in sorted(self.units.items())},
        }
        (self.out / f"timing-{os.getpid()}.json").write_text(json.dumps(record, indent=1) + "\n")


def timing_dir(root: Path) -> Path:
    """Where a run under ``root`` writes its timing files."""
    return Path(os.environ.get("UCM_TEST_TIMING_DIR") or root / "build" / "test-timing")


LANE = "UCM_TEST_LANE"  # set by ucm_testing.lanes in each lane's pytest
RECORDING = "UCM_TEST_TIMING_RECORDING"  # set in a recording process: a pytest a test starts skips


def pytest_configure(config: pytest.Config) -> None:
    if config.option.collectonly or os.environ.get(RECORDING):
        return  # nothing runs here (a collection) or a run inside a test
    os.environ[RECORDING] = "1"
    out = timing_dir(config.rootpath)
    lane = os.environ.get(LANE, "all")  # a plain pytest run is the whole suite
    config.pluginmanager.register(TimingPlugin(out, lane), "ucm-test-timing")
