"""The statistics behind the benchmarks' accuracy claims: known values and the properties the
paired-difference interval must have."""

from __future__ import annotations

import math

import pytest

from ucm_testing.stats import mcnemar_exact, paired, paired_difference, wilson


def test_wilson_known_values():
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson(50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)


def test_mcnemar_exact_is_a_binomial_test_on_the_discordant_pairs():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(1, 0) == 1.0
    assert mcnemar_exact(10, 0) == pytest.approx(2 / 1024)
    assert mcnemar_exact(8, 0) == pytest.approx(2 / 256)  # the example: 8 lost, none gained
    two_sided = 2 * sum(math.comb(10, i) for i in range(4)) / 1024
    assert mcnemar_exact(3, 7) == mcnemar_exact(7, 3) == pytest.approx(two_sided)


def test_paired_counts_and_direction():
    first = [True] * 60 + [False] * 40
    second = [True] * 55 + [False] * 5 + [True] * 2 + [False] * 38
    r = paired(first, second)
    assert (r.n, r.only_first, r.only_second) == (100, 5, 2)
    assert r.difference == pytest.approx(-0.03)
    lo, hi = r.difference_interval
    assert lo < -0.03 < hi
    swapped = paired(second, first)
    assert swapped.difference_interval == pytest.approx((-hi, -lo))


def test_identical_arms_give_an_interval_around_zero_that_shrinks_with_n():
    widths = []
    for n in (20, 100, 1000):
        lo, hi = paired_difference(n // 2, 0, 0, n - n // 2)
        assert lo < 0 < hi
        assert hi == pytest.approx(1.96**2 / (n + 1.96**2), rel=1e-3)  # no discordant pair: z^2 / (n + z^2)
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]
