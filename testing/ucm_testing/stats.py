"""Statistics for paired accuracy claims (the same prompts answered by two arms).

- :func:`wilson`: the Wilson score interval of one proportion (good at small n and near 0 or 1).
- :func:`mcnemar_exact`: the two-sided exact McNemar test — a binomial test on the discordant pairs
  (one arm right, the other wrong); concordant pairs say nothing about a difference.
- :func:`paired_difference`: Tango's score interval (1998) for the difference of two paired
  proportions: the differences whose score test on the discordant pairs does not reject. Unlike
  the Wald interval it behaves when discordant pairs are few, and unlike Newcombe's hybrid
  interval it does not collapse to a point when there are none (100 agreeing pairs still leave
  about +-3.7 points).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided p-value for "the arms are equally often right" from the discordant counts."""
    n = only_first + only_second
    if n == 0:
        return 1.0
    k = min(only_first, only_second)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class Paired:
    n: int
    first: float  # accuracy of the first arm
    second: float
    first_interval: tuple[float, float]
    second_interval: tuple[float, float]
    only_first: int  # pairs the first arm got right and the second wrong
    only_second: int
    mcnemar_p: float
    difference: float  # second - first
    difference_interval: tuple[float, float]


def paired(first: Sequence[bool], second: Sequence[bool], z: float = Z95) -> Paired:
    """Compare two arms' outcomes on the same trials (``second - first``)."""
    if len(first) != len(second):
        raise ValueError("paired: both arms need an outcome for every trial")
    n = len(first)
    both = sum(a and b for a, b in zip(first, second, strict=True))
    only_first = sum(a and not b for a, b in zip(first, second, strict=True))
    only_second = sum(b and not a for a, b in zip(first, second, strict=True))
    neither = n - both - only_first - only_second
    s1, s2 = both + only_first, both + only_second
    lo, hi = paired_difference(both, only_first, only_second, neither, z)
    return Paired(
        n=n,
        first=s1 / n if n else 0.0,
        second=s2 / n if n else 0.0,
        first_interval=wilson(s1, n, z),
        second_interval=wilson(s2, n, z),
        only_first=only_first,
        only_second=only_second,
        mcnemar_p=mcnemar_exact(only_first, only_second),
        difference=(s2 - s1) / n if n else 0.0,
        difference_interval=(lo, hi),
    )


def paired_difference(
    both: int, only_first: int, only_second: int, neither: int, z: float = Z95
) -> tuple[float, float]:
    """Tango's interval for p2 - p1 of paired proportions, from the 2x2 table of outcomes."""
    n = both + only_first + only_second + neither
    if n == 0:
        return (-1.0, 1.0)
    b, c = only_second, only_first  # d = (b - c) / n

    def score(d: float) -> float:
        # the score statistic at difference d, with the discordant-pair probability p_c at its
        # maximum likelihood under d (the root of a quadratic)
        qa, qb, qc = 2 * n, -b - c + (2 * n - b + c) * d, -c * d * (1 - d)
        p_c = (-qb + math.sqrt(max(0.0, qb * qb - 4 * qa * qc))) / (2 * qa)
        var, excess = n * (2 * p_c + d * (1 - d)), b - c - n * d
        if var > 0:
            return excess / math.sqrt(var)
        return 0.0 if excess == 0 else math.copysign(math.inf, excess)

    def root(target: float) -> float:  # score falls as d grows: bisection for score(d) == target
        lo, hi = -1.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            if score(mid) > target:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    return (root(z), root(-z))
