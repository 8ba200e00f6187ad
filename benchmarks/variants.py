"""Benchmark arms named as an algorithm and options: ``gsa:summary_dtype=bfloat16:sparse_ratio=0.2``
(side by side in one run with plain ``gsa``)."""

from __future__ import annotations

import json
from typing import Any


def parse_variant(name: str) -> tuple[str, dict[str, Any]]:
    """(algorithm, options) of an arm's name; option values as JSON (numbers, booleans) or the string given."""
    algorithm, *variant = name.split(":")
    options: dict[str, Any] = {}
    for option in variant:
        key, eq, value = option.partition("=")
        if not eq:
            raise SystemExit(f"--algorithms: {name!r}: variant options are key=value, got {option!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return algorithm, options
