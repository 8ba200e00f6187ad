"""Where make test's time goes: ucm_testing.timing's units and scripts/test_timing.py's table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ucm_testing.timing import unit_of

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(ROOT / "scripts" / "test_timing.py")]


def test_units_are_modules_and_each_benchmark_smoke():
    assert unit_of("tests/store/test_posix.py::test_x[a]") == "tests/store/test_posix.py"
    benchmark = "tests/test_benchmarks.py::test_blend_serving_reuses_chunks_cached_alone"
    assert unit_of(benchmark) == benchmark


def test_the_timing_table_comes_from_the_lanes_files(tmp_path):
    runs = tmp_path / "timing"
    runs.mkdir()
    unit = {"tests": 2, "wall_s": 100.0, "cpu_s": 150.0, "engines": 3, "peak_gib": 4.5}
    light = {"tests": 1, "wall_s": 20.0, "cpu_s": 0.0, "engines": 0, "peak_gib": 0.5}
    engines = {
        "started": 1000.0,
        "wall_s": 150.0,
        "machine_peak_gib": 12.0,
        "cores": 2,
        "lane": "engines",
        "units": {"tests/test_a.py": unit, "tests/test_c.py": {**light, "engines": 1}},
    }
    beside = {**engines, "started": 1010.0, "wall_s": 60.0, "lane": "beside"}
    beside["units"] = {"tests/test_b.py": {**light, "wall_s": 50.0}, "tests/test_c.py": light}
    (runs / "timing-1.json").write_text(json.dumps(engines))
    (runs / "timing-2.json").write_text(json.dumps(beside))
    doc = tmp_path / "development.md"
    doc.write_text("# Dev\n\n<!-- test-timing:begin -->\nold\n<!-- test-timing:end -->\n\nafter\n")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "test_timing.py"),
            "--dir",
            str(runs),
            "--doc",
            str(doc),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    text = doc.read_text()
    assert "old" not in text and text.endswith("<!-- test-timing:end -->\n\nafter\n")
    # The lanes overlap: the run lasts from the first lane's start to the last one's end.
    assert "From the run of 1970-01-01: pytest 2.5 min, 2.5 CPU-min (50% of 2 cores), 5 tests," in text
    assert "| `tests/test_a.py` | engines | 2 | 100 | 150 | 1.50 | 3 | 4.5 |" in text
    assert "| `tests/test_b.py` | beside | 1 | 50 | 0 | 0.00 | 0 | 0.5 |" in text
    assert "| `tests/test_c.py` | beside + engines | 2 | 40 | 0 | 0.00 | 1 | 0.5 |" in text
    assert text.index("tests/test_a.py") < text.index("tests/test_b.py")  # longest first
    assert "| `tests/test_a.py` |" in out


def test_the_timing_script_says_when_there_is_no_run(tmp_path):
    r = subprocess.run(
        [*SCRIPT, "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "no timing-*.json (run make test first)" in r.stderr
