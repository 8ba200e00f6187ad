"""``make test``'s pytest: two lanes side by side, so the suite's waits leave no core idle.

The **engines** lane runs the tests marked ``engines`` (those that start vLLM engines or stacks, and
those that measure time: every benchmark smoke, all of ``e2e/``, modules whose assertions bound a
time), one after another, as the whole
suite ran before: its memory peaks (up to ~13 GiB for one module) never meet each other, and its
timings are calibrated on a machine that runs nothing else heavy. The **beside** lane runs every
other test in a second pytest process at the same time: the operator on its API server emulator,
the proxy, the stores, the deploy and render logic — together under 1 GiB and a fraction of a core,
which fits the gaps an engine lane leaves (an engine start is one core importing Python).

Each lane is a pytest process in its own process group. SIGTERM or SIGINT (a CI time limit, Ctrl-C)
is passed to each lane once, so each tears its fixtures down and prints its summary
(``ucm_testing.ci_report``). The engines lane prints as it goes; the beside lane writes
``build/test-lanes/beside.log``, printed when both are done. The run fails if either lane fails, or
if the beside lane started a vLLM engine (a module missing its ``engines`` mark: ``ucm_testing.timing``
counts engines per module).

    .venv/bin/python -m ucm_testing.lanes
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from ucm_testing.timing import LANE, timing_dir

LANES = {"engines": "engines", "beside": "not engines"}  # lane -> its marker expression
ROOT = Path.cwd()
LOGS = ROOT / "build" / "test-lanes"
PR_SET_PDEATHSIG = 1


def _die_with_the_runner() -> None:
    """In a lane, before exec: SIGTERM when the runner dies (a SIGKILL to make's group, a SIGHUP),
    which reaches the lane no other way from its own process group."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start(lane: str, log: Path | None) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "pytest", "-q", "-m", LANES[lane]]
    out = None if log is None else log.open("wb")
    env = {**os.environ, LANE: lane}
    # Its own process group: a signal to make's group reaches the lanes only through forward(),
    # once, so that a second SIGTERM does not cut the lane's teardown short.
    return subprocess.Popen(
        command,
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        env=env,
        process_group=0,
        preexec_fn=_die_with_the_runner,
    )


def engines_started(pid: int) -> dict[str, int]:
    """The units of a finished lane that started vLLM engines, from its timing record."""
    record = timing_dir(ROOT) / f"timing-{pid}.json"
    if not record.exists():
        return {}  # the lane was cut off before it wrote one
    units = json.loads(record.read_text())["units"]
    return {name: unit["engines"] for name, unit in units.items() if unit["engines"]}


def main() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    beside_log = LOGS / "beside.log"
    lanes: dict[str, subprocess.Popen[bytes]] = {}
    forwarded: set[int] = set()

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum in forwarded:
            return  # once: a second signal would cut the lanes' own teardown short
        forwarded.add(signum)
        for proc in lanes.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)  # before the lanes start: none misses a signal
    signal.signal(signal.SIGINT, forward)
    lanes["beside"] = start("beside", beside_log)
    lanes["engines"] = start("engines", None)
    print(
        f"make test: the beside lane (tests not marked `engines`) runs in pid {lanes['beside'].pid}, log {beside_log}"
    )
    sys.stdout.flush()
    codes = {lane: lanes[lane].wait() for lane in ("engines", "beside")}

    sys.stdout.flush()
    print(f"\n---- the beside lane ({beside_log}) ----", flush=True)
    sys.stdout.buffer.write(beside_log.read_bytes())
    print(f"---- lanes: engines exited {codes['engines']}, beside exited {codes['beside']} ----")
    strays = engines_started(lanes["beside"].pid)
    for unit, count in strays.items():
        print(f"the beside lane started {count} vLLM engine(s) in {unit}: mark it `engines` (see ucm_testing.lanes)")
    failed = [code for code in codes.values() if code]
    return failed[0] if failed else int(bool(strays))


if __name__ == "__main__":
    sys.exit(main())
