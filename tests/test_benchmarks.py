"""Benchmarks at their smallest size: each finishes, its flow holds, and it writes its summary keys
(a benchmark no test runs rots unseen)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run_benchmark(script: str, tmp_path: Path, *args: str, timeout: float = 900) -> dict:
    out = tmp_path / "summary.json"
    command = [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)]
    done = subprocess.run(
        [*command, "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


def test_lora_serving_serves_every_adapter_through_pd_without_a_wrong_answer(tmp_path):
    """Four adapters and the base model through ``ucm up``'s PD stack (spec.lora, kv_aware routing),
    every answer against a fresh engine's."""
    summary = run_benchmark("lora_serving.py", tmp_path, "--quick")
    assert summary["lora_wrong_answers"] == 0
    assert summary["lora_tokens_checked"] > summary["lora_tokens_served"] // 2  # most steps have a clear winner
    assert summary["prefill_hit_tokens"]["adapters"] > 0  # adapters' prompts were reused, not only computed
    assert set(summary["ttft_by_arm"]) == {"tiny", "ad1", "ad2", "ad3", "ad4"}
    assert "lora_hit_tokens_vs_no_adapters" in summary
