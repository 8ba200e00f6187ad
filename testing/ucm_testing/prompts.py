"""Prompts for equality tests on the demo model: 4-5 full blocks of 32 tokens, greedy continuations
with a top-2 logit margin >= 0.1 at every one of 32 steps (checked in tests/test_demo_model.py),
so a KV reload or another batch shape cannot flip a near-tie."""

from __future__ import annotations

from ucm.deploy.demo_model import CORPUS

_SENTENCES = CORPUS.split("\n")
# Chosen by their margins (>= 0.37 on the pinned model); see the module docstring.
_PICKS = (0, 2, 5, 6, 10, 11, 12, 15, 17)


def _prompt(i: int) -> str:
    n = len(_SENTENCES)
    return " ".join(_SENTENCES[(i + k) % n] for k in (0, 3, 7, 11)) + " " + _SENTENCES[(i + 5) % n][:30]


PROMPTS: tuple[str, ...] = tuple(_prompt(i) for i in _PICKS)
