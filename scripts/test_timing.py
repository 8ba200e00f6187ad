"""The table of where ``make test``'s time goes (docs/development.md), from the timing file a run
left (``ucm_testing.timing``, in ``build/test-timing``).

    .venv/bin/python scripts/test_timing.py [--dir build/test-timing] [--doc docs/development.md]

Rewrites the text between the table's markers in the page and prints the table. A unit is a test
module, or one test of ``tests/test_benchmarks.py`` (``ucm_testing.timing.unit_of``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- test-timing:begin -->", "<!-- test-timing:end -->"
SUMMED = ("tests", "wall_s", "cpu_s", "engines")


def load(directory: Path) -> list[dict]:
    runs = [json.loads(path.read_text()) for path in sorted(directory.glob("timing-*.json"))]
    if not runs:
        raise SystemExit(f"{directory}: no timing-*.json (run make test first)")
    return runs


def merged(runs: list[dict]) -> dict[str, dict]:
    """Each unit's figures over the runs left in the directory (one per lane, after make test); a
    unit whose tests ran in both lanes is in both."""
    units: dict[str, dict] = {}
    for run in runs:
        for name, timing in run["units"].items():
            unit = units.setdefault(name, dict.fromkeys(SUMMED, 0.0) | {"peak_gib": 0.0, "lanes": set()})
            for field in SUMMED:
                unit[field] += timing[field]
            unit["peak_gib"] = max(unit["peak_gib"], timing["peak_gib"])
            unit["lanes"].add(run.get("lane", "all"))
    for unit in units.values():
        unit["lane"] = " + ".join(sorted(unit.pop("lanes")))
    return units


def table(runs: list[dict], units: dict[str, dict]) -> str:
    start = min(run["started"] for run in runs)
    wall = max(run["started"] + run["wall_s"] for run in runs) - start
    cores = max(run["cores"] for run in runs)
    cpu = sum(u["cpu_s"] for u in units.values())
    day = time.strftime("%Y-%m-%d", time.gmtime(start))
    lines = [
        f"From the run of {day}: pytest {wall / 60:.1f} min, {cpu / 60:.1f} CPU-min "
        f"({cpu / (wall * cores):.0%} of {cores} cores), {sum(u['tests'] for u in units.values()):.0f} tests, "
        f"{sum(u['engines'] for u in units.values()):.0f} vLLM engines started, machine memory in use peaked at "
        f"{max(run['machine_peak_gib'] for run in runs):.1f} GiB.",
        "",
        "| unit | lane | tests | wall s | CPU-s | CPU/wall | engines | peak GiB |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for name, u in sorted(units.items(), key=lambda item: -item[1]["wall_s"]):
        ratio = u["cpu_s"] / u["wall_s"] if u["wall_s"] else 0.0
        lines.append(
            f"| `{name}` | {u['lane']} | {u['tests']:.0f} | {u['wall_s']:.0f} | {u['cpu_s']:.0f} | {ratio:.2f} | "
            f"{u['engines']:.0f} | {u['peak_gib']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=ROOT / "build" / "test-timing")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "development.md")
    args = parser.parse_args()
    page = args.doc.read_text()
    if BEGIN not in page or END not in page:
        sys.exit(f"{args.doc}: no {BEGIN} ... {END} markers to write the table between")
    runs = load(args.dir)
    text = table(runs, merged(runs))
    print(text)
    head, rest = page.split(BEGIN, 1)
    args.doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main()
