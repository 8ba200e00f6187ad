"""The Triton selection kernels (ucm/sparse/triton_select.py) under Triton's CPU interpreter, in a
process of their own (tests/sparse/triton_cases.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_triton_selection_matches_the_native_kernel_under_the_interpreter():
    cases = Path(__file__).with_name("triton_cases.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
