"""The table of where ``make test``'s time goes (docs/development.md), from the timing files a run
left (``ucm_testing.timing``: one per pytest process, in ``build/test-timing``).

    .venv/bin/python scripts/test_timing.py [--dir build/test-timing] [--doc docs/development.md] [--costs FILE]

Rewrites the text between the table's markers in the page and the units' seconds and memory the
test schedule orders and budgets by (``testing/ucm_testing/unit_costs.json``); prints the table.
A unit is what the schedule hands a worker whole: a test module, modules sharing fixtures, or one
test of a module split per test (``ucm_testing.schedule.unit_of``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- test-timing:begin -->", "<!-- test-timing:end -->"
COSTS = ROOT / "testing" / "ucm_testing" / "unit_costs.json"
SUMMED = ("tests", "wall_s", "cpu_s", "engines")


def load(directory: Path) -> list[dict]:
    runs = [json.loads(path.read_text()) for path in sorted(directory.glob("timing-*.json"))]
    if not runs:
        raise SystemExit(f"{directory}: no timing-*.json (run make test first)")
    return runs


def merged(runs: list[dict]) -> dict[str, dict]:
    """Each unit's figures over the processes that ran it (a unit runs in one; a rerun adds up)."""
    units: dict[str, dict] = {}
    for run in runs:
        for name, timing in run["units"].items():
            unit = units.setdefault(name, dict.fromkeys(SUMMED, 0.0) | {"peak_gib": 0.0, "workers": set()})
            for field in SUMMED:
                unit[field] += timing[field]
            unit["peak_gib"] = max(unit["peak_gib"], timing["peak_gib"])
            unit["workers"].add(run["worker"])
    return units


def phase_line(name: str, runs: list[dict]) -> str:
    start = min(run["started"] for run in runs)
    wall = max(run["started"] + run["wall_s"] for run in runs) - start
    cpu = sum(t["cpu_s"] for run in runs for t in run["units"].values())
    cores = max(run["cores"] for run in runs)
    return (
        f"- {name}: {wall / 60:.1f} min over {len(runs)} process(es), {cpu / 60:.1f} CPU-min "
        f"({cpu / (wall * cores):.0%} of {cores} cores), "
        f"{sum(t['tests'] for run in runs for t in run['units'].values())} tests, "
        f"{sum(t['engines'] for run in runs for t in run['units'].values())} vLLM engines started, "
        f"machine memory in use peaked at {max(run['machine_peak_gib'] for run in runs):.1f} GiB"
    )


def table(runs: list[dict], units: dict[str, dict]) -> str:
    parallel = [run for run in runs if run["worker"] != "main"]
    serial = [run for run in runs if run["worker"] == "main"]
    day = time.strftime("%Y-%m-%d", time.gmtime(min(run["started"] for run in runs)))
    lines = [f"From the run of {day} (`make test`'s two pytest runs):", ""]
    if parallel:
        lines.append(phase_line("in parallel (one worker per core)", parallel))
    if serial:
        lines.append(phase_line("serial (alone, every core)", serial))
    lines += [
        "",
        "| unit | tests | wall s | CPU-s | CPU/wall | engines | peak GiB | ran on |",
        "|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for name, u in sorted(units.items(), key=lambda item: -item[1]["wall_s"]):
        ratio = u["cpu_s"] / u["wall_s"] if u["wall_s"] else 0.0
        lines.append(
            f"| `{name}` | {u['tests']:.0f} | {u['wall_s']:.0f} | {u['cpu_s']:.0f} | {ratio:.2f} | "
            f"{u['engines']:.0f} | {u['peak_gib']:.1f} | {', '.join(sorted(u['workers']))} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=ROOT / "build" / "test-timing")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "development.md")
    parser.add_argument("--costs", type=Path, default=COSTS)
    args = parser.parse_args()
    page = args.doc.read_text()
    if BEGIN not in page or END not in page:
        sys.exit(f"{args.doc}: no {BEGIN} ... {END} markers to write the table between")
    runs = load(args.dir)
    units = merged(runs)
    text = table(runs, units)
    print(text)
    costs = {
        name: {"seconds": round(u["wall_s"], 1), "peak_gib": round(u["peak_gib"], 2)}
        for name, u in sorted(units.items())
    }
    args.costs.write_text(json.dumps(costs, indent=1) + "\n")
    head, rest = page.split(BEGIN, 1)
    args.doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main()
