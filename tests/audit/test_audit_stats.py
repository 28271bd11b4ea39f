"""The timing suite's statistics against brute force: U by its pairwise definition, exact
p-values by listing every relabelling of the pooled sample, the normal approximation against
a large Monte Carlo permutation test, and the block size implied by cached-token counts."""

from __future__ import annotations

import itertools
import random

import pytest

from kvpage.audit.stats import (
    block_size_from_cached,
    mann_whitney,
    median,
    midranks,
    u_statistic,
)


def _brute_p(x: list[float], y: list[float], alternative: str) -> float:
    """Every assignment of the pooled values to two groups of the original sizes (as index
    sets, so equal values are still distinct draws), U computed pairwise for each."""
    pooled, n1 = x + y, len(x)
    observed = u_statistic(x, y)
    centre = len(x) * len(y) / 2
    hits = total = 0
    for members in itertools.combinations(range(len(pooled)), n1):
        chosen = set(members)
        a = [pooled[i] for i in members]
        b = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        u = u_statistic(a, b)
        total += 1
        if alternative == "less":
            hits += u <= observed + 1e-9
        elif alternative == "greater":
            hits += u >= observed - 1e-9
        else:
            hits += abs(u - centre) >= abs(observed - centre) - 1e-9
    return hits / total


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("alternative", ["less", "greater", "two-sided"])
def test_exact_test_matches_brute_force(seed, alternative):
    rng = random.Random(seed)
    n1, n2 = rng.randint(2, 6), rng.randint(2, 6)
    # few distinct values, so ties are common
    x = [float(rng.randint(0, 5)) for _ in range(n1)]
    y = [float(rng.randint(1, 6)) for _ in range(n2)]
    result = mann_whitney(x, y, alternative)
    assert result.method == "exact"
    assert result.u == pytest.approx(u_statistic(x, y))
    assert result.p == pytest.approx(_brute_p(x, y, alternative))
    assert result.effect == pytest.approx(2 * u_statistic(x, y) / (n1 * n2) - 1)


def test_complete_separation():
    x, y = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    less = mann_whitney(x, y, "less")
    assert less.u == 0 and less.effect == -1
    assert less.p == pytest.approx(1 / 924)  # one split of C(12, 6) is this extreme
    assert mann_whitney(x, y, "greater").p == 1.0
    assert mann_whitney(y, x, "greater").p == pytest.approx(1 / 924)


def test_normal_approximation_agrees_with_permutation_on_large_samples():
    rng = random.Random(7)
    x = [rng.gauss(0.0, 1.0) for _ in range(40)]
    y = [rng.gauss(0.5, 1.0) for _ in range(45)]
    normal = mann_whitney(x, y, "less", method="normal")
    sampled = mann_whitney(x, y, "less", method="monte-carlo")
    assert normal.method == "normal" and normal.z is not None
    assert normal.p == pytest.approx(sampled.p, abs=0.01)
    assert mann_whitney(x, y, "less").method == "normal"  # what "auto" picks here


def test_normal_approximation_with_ties_is_corrected():
    """Four distinct values in 85: without the tie correction p is ~0.072, not ~0.061."""
    rng = random.Random(3)
    x = [float(rng.randint(0, 3)) for _ in range(40)]
    y = [float(rng.randint(0, 3)) + (rng.random() < 0.75) for _ in range(45)]
    normal = mann_whitney(x, y, "two-sided", method="normal")
    sampled = mann_whitney(x, y, "two-sided", method="monte-carlo")
    assert 0.03 < sampled.p < 0.1
    assert normal.p == pytest.approx(sampled.p, abs=0.004)
    same = mann_whitney([1.0] * 30, [1.0] * 30, "two-sided", method="normal")
    assert same.p == 1.0  # every value tied: no evidence either way


def test_midranks_and_median():
    assert midranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0]) == 2.5 and median([]) is None


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="alternative"):
        mann_whitney([1.0], [2.0], "sideways")
    with pytest.raises(ValueError, match="at least one"):
        mann_whitney([], [2.0])


def test_block_size_from_cached_counts():
    assert block_size_from_cached([0, 16, 32, 48, 0]) == 16
    assert block_size_from_cached([32, 64, 96]) == 32
    assert block_size_from_cached([0, 0, 64]) is None  # one hit: any divisor fits
