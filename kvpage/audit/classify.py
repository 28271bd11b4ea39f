"""Is a divergence a bug? Three classes, judged against the server's own run-to-run noise:

- noise: no larger than what the same request alone, twice, already shows (baseline suite);
- numeric drift: float reassociation (batched kernels, other reduction orders): the logprobs
  before the flip agree within tolerance and the flip is between the solo run's top two tokens
  at a near-tie (top-2 gap below tolerance);
- isolation: a foreign canary, or a flip at a clear margin, or logprobs that moved beyond what
  float noise does — the request saw context that is not its own.

Without logprobs a flip's margin is unknown: such a divergence is `unclassified`, never guessed."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.audit.compare import Divergence
from kvpage.audit.completion import END
from kvpage.audit.config import Tolerances

NOISE, DRIFT, ISOLATION, UNCLASSIFIED = "noise", "numeric_drift", "isolation", "unclassified"

# suite verdicts
CLEAN, DRIFT_ONLY, FAILED = "clean", "numeric drift", "isolation failure"
INCONCLUSIVE = "inconclusive"
SERVER_ERRORS = "server errors"  # requests failed (5xx) under sharing or concurrency

# Once the batch suite has measured how far the server's logprobs move under batching alone
# (`drift_scale`), drift is bounded by that scale times DRIFT_FACTOR (never below DRIFT_FLOOR,
# never above the configured tolerances): a float32 server whose batches move logprobs by 1e-6
# does not get to call a 0.05 change "drift".
DRIFT_FACTOR = 10.0
DRIFT_FLOOR = 1e-3


@dataclass(slots=True)
class Noise:
    """The server's run-to-run noise, from the baseline suite (identical requests, alone)."""

    measured: bool = False
    token_flips: int = 0  # baseline pairs whose tokens differed
    logprob_spread: float = 0.0  # max |Δ logprob| between identical solo runs
    flip_gaps: list[float] = field(default_factory=list)  # solo top-2 gap where they flipped
    drift_scale: float | None = None  # max |Δ logprob| under batching alone (batch suite)

    @property
    def flip_gap_bound(self) -> float:
        return max(self.flip_gaps, default=0.0)


def effective(tol: Tolerances, noise: Noise) -> Tolerances:
    """The tolerances, tightened to the server's measured batching drift where known."""
    if noise.drift_scale is None:
        return tol
    bound = max(DRIFT_FACTOR * noise.drift_scale, DRIFT_FLOOR)
    return Tolerances(tol.exact, min(tol.logprob, bound), min(tol.gap, bound))


@dataclass(frozen=True, slots=True)
class Classification:
    klass: str
    reason: str


def classify(
    div: Divergence, noise: Noise, tol: Tolerances, foreign_canary: str | None = None
) -> Classification:
    if foreign_canary is not None:
        return Classification(ISOLATION, f"foreign canary in the output: {foreign_canary}")
    tol = effective(tol, noise)
    if div.logprob_only:
        return _logprob_only(div.prior_delta or 0.0, noise, tol)
    return _token_flip(div, noise, tol)


def _logprob_only(delta: float, noise: Noise, tol: Tolerances) -> Classification:
    if delta <= max(noise.logprob_spread, tol.exact):
        return Classification(NOISE, f"same tokens; |Δ logprob| {delta:.3g} within baseline noise")
    if delta <= tol.logprob:
        return Classification(
            DRIFT, f"same tokens; |Δ logprob| {delta:.3g} <= tolerance {tol.logprob:g}"
        )
    return Classification(
        ISOLATION,
        f"same tokens but |Δ logprob| {delta:.3g} > tolerance {tol.logprob:g}: "
        "the request attended to different context",
    )


def _token_flip(div: Divergence, noise: Noise, tol: Tolerances) -> Classification:
    prior, gap = div.prior_delta, div.ref_gap
    if gap is None or prior is None:
        if noise.token_flips:
            return Classification(NOISE, "the server flips tokens run to run (no logprobs)")
        return Classification(
            UNCLASSIFIED, "no logprobs: the flip's margin is unknown (baseline was exact)"
        )
    if noise.token_flips and gap <= noise.flip_gap_bound and prior <= noise.logprob_spread:
        return Classification(
            NOISE, f"flip at top-2 gap {gap:.3g}, within the baseline's own flips"
        )
    runner_up = div.cand_rank_in_ref == 2 or END in (div.cand_token, div.ref_token)
    if prior <= tol.logprob and gap <= tol.gap and runner_up:
        return Classification(
            DRIFT,
            f"near-tie flip to the solo runner-up: top-2 gap {gap:.3g} <= {tol.gap:g}, "
            f"earlier logprobs within {prior:.3g}",
        )
    return Classification(ISOLATION, _margin_reason(div, prior, gap, tol))


def _margin_reason(div: Divergence, prior: float, gap: float, tol: Tolerances) -> str:
    if prior > tol.logprob:
        return f"logprobs before the flip already differed by {prior:.3g} > {tol.logprob:g}"
    if gap > tol.gap:
        return f"flip at a clear margin: solo top-2 gap {gap:.3g} > {tol.gap:g}"
    rank = div.cand_rank_in_ref
    where = f"rank {rank}" if rank else "outside the solo top-k"
    return f"the new token is {where} of the solo run, not its runner-up"


def suite_verdict(classes: list[str], server_errors: int = 0) -> str:
    """The worst finding decides: isolation > failed requests > unclassified > drift > none."""
    if ISOLATION in classes:
        return FAILED
    if server_errors:
        return SERVER_ERRORS
    if UNCLASSIFIED in classes:
        return INCONCLUSIVE
    if DRIFT in classes:
        return DRIFT_ONLY
    return CLEAN
