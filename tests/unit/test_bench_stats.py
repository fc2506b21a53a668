"""The benchmarks' statistics: the confidence interval of a median (pure logic)."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.harness import median_ci95


def _coverage(n: int, lo: int, hi: int) -> float:
    """P(x(lo) <= true median <= x(hi)) for n samples of any continuous distribution."""
    return sum(math.comb(n, k) for k in range(lo + 1, hi + 1)) / 2**n


@pytest.mark.parametrize("n", [6, 7, 9, 25, 26, 50, 151])
def test_interval_covers_at_least_95_percent_and_is_the_tightest_such(n: int) -> None:
    lo_v, hi_v = median_ci95(list(range(n)))  # samples 0..n-1: values are their ranks
    lo, hi = int(lo_v), int(hi_v)
    assert hi == n - 1 - lo  # symmetric in rank
    assert _coverage(n, lo, hi) >= 0.95
    if lo + 1 < hi - 1:  # one rank tighter on each side would fall below 95 %
        assert _coverage(n, lo + 1, hi - 1) < 0.95


def test_interval_holds_the_median_and_ignores_order() -> None:
    rng = random.Random(7)
    xs = [rng.lognormvariate(0, 0.1) for _ in range(101)]
    ci = median_ci95(xs)
    assert ci is not None
    ys = sorted(xs)
    assert ci[0] <= ys[50] <= ci[1]
    rng.shuffle(xs)
    assert median_ci95(xs) == ci


def test_interval_narrows_with_more_samples() -> None:
    rng = random.Random(3)
    xs = [rng.gauss(1.0, 0.1) for _ in range(400)]
    small, large = median_ci95(xs[:25]), median_ci95(xs)
    assert small is not None and large is not None
    assert large[1] - large[0] < small[1] - small[0]


def test_too_few_samples_give_no_interval() -> None:
    assert median_ci95([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert median_ci95([]) is None
