"""Two-sample tests for the timing suite, implemented here (no scipy): the Mann–Whitney U test
with an exact permutation p-value for small samples and the tie-corrected normal approximation
for large ones, the rank-biserial effect size, and the block size implied by cached-token counts."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import asdict, dataclass
from typing import Any

EXACT_LIMIT = 200_000  # enumerate every split up to this many; sample beyond it
MONTE_CARLO_DRAWS = 20_000
ALTERNATIVES = ("less", "greater", "two-sided")
METHODS = ("exact", "monte-carlo", "normal")


@dataclass(frozen=True, slots=True)
class MannWhitney:
    u: float  # pairs (x_i, y_j) with x_i > y_j, ties counted one half
    n1: int
    n2: int
    p: float
    alternative: str  # "less": x tends to be smaller than y
    method: str  # "exact", "monte-carlo" or "normal"
    effect: float  # rank-biserial correlation in [-1, 1]; -1: every x below every y
    z: float | None = None  # the normal approximation's statistic, when used

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def u_statistic(x: list[float], y: list[float]) -> float:
    """U of x by its definition (O(n1·n2)); the rank formula below must agree with it."""
    return sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in x for b in y)


def midranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of their positions."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def mann_whitney(
    x: list[float],
    y: list[float],
    alternative: str = "less",
    seed: int = 0,
    method: str = "auto",
) -> MannWhitney:
    """Is x stochastically smaller ("less"), larger ("greater") or either ("two-sided") than y?
    `method` "auto" picks exact enumeration when it is cheap, else Monte Carlo for small samples
    and the normal approximation for large ones; or name one of them."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
    if method not in ("auto", *METHODS):
        raise ValueError(f"method must be auto or one of {METHODS}, got {method!r}")
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError("both samples need at least one value")
    ranks = midranks(list(x) + list(y))
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    effect = 2 * u / (n1 * n2) - 1
    if method == "auto":
        method = _auto_method(n1, n2)
    if method == "exact":
        p = _permutation_p(ranks, n1, u, alternative, None)
        return MannWhitney(u, n1, n2, p, alternative, "exact", effect)
    if method == "monte-carlo":
        p = _permutation_p(ranks, n1, u, alternative, random.Random(seed))
        return MannWhitney(u, n1, n2, p, alternative, "monte-carlo", effect)
    z, p = _normal_p(ranks, n1, n2, u, alternative)
    return MannWhitney(u, n1, n2, p, alternative, "normal", effect, z)


def _auto_method(n1: int, n2: int) -> str:
    if math.comb(n1 + n2, n1) <= EXACT_LIMIT:
        return "exact"
    return "monte-carlo" if n1 + n2 < 40 else "normal"  # the normal curve needs some values


def _u_of(ranks: list[float], members: tuple[int, ...], n1: int) -> float:
    return sum(ranks[i] for i in members) - n1 * (n1 + 1) / 2


def _permutation_p(
    ranks: list[float], n1: int, u: float, alternative: str, rng: random.Random | None
) -> float:
    """The share of splits of the pooled ranks at least as extreme as the observed one."""
    n = len(ranks)
    if rng is None:
        splits = itertools.combinations(range(n), n1)
    else:
        splits = (tuple(rng.sample(range(n), n1)) for _ in range(MONTE_CARLO_DRAWS))
    centre, eps = n1 * (n - n1) / 2, 1e-9
    hits = total = 0
    for members in splits:
        v = _u_of(ranks, members, n1)
        total += 1
        if alternative == "less":
            hits += v <= u + eps
        elif alternative == "greater":
            hits += v >= u - eps
        else:
            hits += abs(v - centre) >= abs(u - centre) - eps
    if rng is not None:  # the observed split counts as one draw (never p = 0 by sampling)
        return (hits + 1) / (total + 1)
    return hits / total


def _normal_p(
    ranks: list[float], n1: int, n2: int, u: float, alternative: str
) -> tuple[float, float]:
    n = n1 + n2
    ties = _tie_counts(ranks)
    tie_term = sum(t**3 - t for t in ties) / (n * (n - 1))
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term))
    mu = n1 * n2 / 2
    if sigma == 0:
        return 0.0, 1.0
    if alternative == "less":
        z = (u - mu + 0.5) / sigma
        return z, _phi(z)
    if alternative == "greater":
        z = (u - mu - 0.5) / sigma
        return z, 1 - _phi(z)
    z = (abs(u - mu) - 0.5) / sigma
    return z, min(1.0, 2 * (1 - _phi(z)))


def _tie_counts(ranks: list[float]) -> list[int]:
    counts: dict[float, int] = {}
    for r in ranks:
        counts[r] = counts.get(r, 0) + 1
    return [c for c in counts.values() if c > 1]


def _phi(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def block_size_from_cached(counts: list[int]) -> int | None:
    """The caching granularity implied by reported cached-token counts: every hit is a whole
    number of blocks, so the block size divides them all (their gcd, from several hits)."""
    hits = [c for c in counts if c > 0]
    return math.gcd(*hits) if len(hits) >= 2 else None
