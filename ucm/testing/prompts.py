"""Prompts for equality tests on the tiny model: 119-160 tokens (4-5 full blocks of 32), greedy
continuations with a top-2 logit margin >= 0.1 at every one of 32 steps (checked in
tests/test_testing_models.py), so a bit-exact KV reload cannot flip a near-tie."""

from __future__ import annotations

from ucm.testing.models import CORPUS

_SENTENCES = CORPUS.split("\n")
# Chosen by their margins; see the module docstring.
_PICKS = (0, 1, 7, 9, 10, 11, 12, 15, 17)


def _prompt(i: int) -> str:
    n = len(_SENTENCES)
    return " ".join(_SENTENCES[(i + k) % n] for k in (0, 3, 7, 11)) + " " + _SENTENCES[(i + 5) % n][:30]


PROMPTS: tuple[str, ...] = tuple(_prompt(i) for i in _PICKS)
