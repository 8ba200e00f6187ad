"""How make test spreads the suite (testing/ucm_testing/schedule.py) and tables where its time went
(scripts/test_timing.py): the choices, the memory ledger, the table."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ucm_testing import schedule
from ucm_testing.schedule import MemoryBudget, largest_unfinished, pick_unit, unit_of

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(ROOT / "scripts" / "test_timing.py")]
MEASURED = {
    "big": {"seconds": 300.0, "peak_gib": 8.0},
    "mid": {"seconds": 200.0, "peak_gib": 5.0},
    "small": {"seconds": 10.0, "peak_gib": 0.2},
}


def test_units_are_modules_shared_groups_and_split_tests():
    assert unit_of("tests/store/test_posix.py::test_x[a]") == "tests/store/test_posix.py"
    assert unit_of("e2e/test_stack.py::test_y") == unit_of("e2e/test_mooncake_stack.py::test_z") == "e2e-plain"
    benchmark = "tests/test_benchmarks.py::test_blend_serving_reuses_chunks_cached_alone"
    assert unit_of(benchmark) == benchmark


def test_a_worker_holds_the_largest_of_its_unfinished_units():
    work = {"big": {"a": True}, "mid": {"b": False, "c": True}, "small": {"d": False}}
    assert largest_unfinished(work, MEASURED) == 5.0  # big is done; mid and small run one after the other
    assert largest_unfinished({}, MEASURED) == 0.0
    assert largest_unfinished({"new": {"e": False}}, MEASURED) == schedule.UNMEASURED["peak_gib"]


def test_the_longest_unit_that_fits_goes_first_and_small_ones_fill_beside_a_large_one():
    queue = ["big", "mid", "small"]
    assert pick_unit(queue, MEASURED, held=0.0, budget=14.0, busy=False) == "big"
    assert pick_unit(queue, MEASURED, held=8.0, budget=14.0, busy=False) == "mid"
    assert pick_unit(queue, MEASURED, held=10.0, budget=14.0, busy=False) == "small"


def test_where_nothing_fits_a_busy_worker_waits_and_an_idle_one_gets_the_smallest():
    queue = ["big", "mid"]
    assert pick_unit(queue, MEASURED, held=10.0, budget=14.0, busy=True) is None
    assert pick_unit(queue, MEASURED, held=10.0, budget=14.0, busy=False) == "mid"


def test_the_ledger_holds_a_unit_until_the_others_leave_room_first_come_first_served(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(schedule, "memory_budget_gib", lambda: 10.0)
    a, b = MemoryBudget("run", "gw0"), MemoryBudget("run", "gw1")
    a.acquire(8.0)
    started = threading.Event()

    def second() -> None:
        b.acquire(4.0)  # 8 + 4 > 10: waits for a
        started.set()

    waiter = threading.Thread(target=second)
    waiter.start()
    time.sleep(1.0)
    assert not started.is_set()
    a.release()
    waiter.join(5)
    assert started.is_set()
    b.release()
    a.acquire(12.0)  # more than the budget, alone: runs
    a.release()
    a.remove()
    assert not list(tmp_path.glob("ucm-test-memory-*"))


def test_the_timing_table_and_costs_come_from_the_runs_files(tmp_path):
    runs = tmp_path / "timing"
    runs.mkdir()
    unit = {"tests": 2, "wall_s": 100.0, "cpu_s": 150.0, "engines": 3, "peak_gib": 4.5}
    for worker, started in (("gw0", 1000.0), ("gw1", 1001.0), ("main", 1200.0)):
        record = {
            "worker": worker,
            "started": started,
            "wall_s": 150.0,
            "machine_peak_gib": 12.0,
            "cores": 2,
            "units": {f"tests/test_{worker}.py": unit},
        }
        (runs / f"timing-{worker}-1.json").write_text(json.dumps(record))
    doc = tmp_path / "development.md"
    doc.write_text("# Dev\n\n<!-- test-timing:begin -->\nold\n<!-- test-timing:end -->\n\nafter\n")
    costs = tmp_path / "unit_costs.json"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "test_timing.py"),
            "--dir",
            str(runs),
            "--doc",
            str(doc),
            "--costs",
            str(costs),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    text = doc.read_text()
    assert "old" not in text and text.endswith("<!-- test-timing:end -->\n\nafter\n")
    assert "- in parallel (one worker per core): 2.5 min over 2 process(es), 5.0 CPU-min" in text
    assert "| `tests/test_gw0.py` | 2 | 100 | 150 | 1.50 | 3 | 4.5 | gw0 |" in text
    assert "| `tests/test_gw0.py` |" in out
    assert json.loads(costs.read_text())["tests/test_main.py"] == {"seconds": 100.0, "peak_gib": 4.5}


def test_the_timing_script_says_when_there_is_no_run(tmp_path):
    r = subprocess.run(
        [*SCRIPT, "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "no timing-*.json (run make test first)" in r.stderr
