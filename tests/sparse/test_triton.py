"""The Triton selection kernels (ucm/sparse/triton_select.py) against the native kernel, in a process
of their own (tests/sparse/triton_cases.py says why): under Triton's CPU interpreter everywhere, and
compiled on a GPU where one is (the device machine; CI has none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_cases(env: dict[str, str]) -> None:
    cases = Path(__file__).with_name("triton_cases.py")
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


def interpreter_breaks_on_loops() -> bool:
    """Triton before 3.7 turns a loop bound into an int with ``int(array)``, which NumPy 2.4 refuses
    for the interpreter's one-element arrays (Triton 3.7 squeezes them first): every kernel with a
    data-dependent loop fails there, whatever it computes (the device machine's Triton 3.6)."""
    import numpy
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7):
        return False
    try:
        int(numpy.array([1]))
    except TypeError:
        return True
    return False


@pytest.mark.skipif(interpreter_breaks_on_loops(), reason="Triton < 3.7's interpreter with NumPy >= 2.4")
def test_triton_selection_matches_the_native_kernel_under_the_interpreter():
    run_cases({**os.environ, "TRITON_INTERPRET": "1"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device machine)")
def test_triton_selection_matches_the_native_kernel_compiled_on_a_gpu():
    run_cases({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
