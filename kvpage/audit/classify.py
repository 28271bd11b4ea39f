"""Is a divergence a bug? Three classes, judged against the server's own run-to-run noise:

- noise: no larger than what the same request alone, twice, already shows (baseline suite);
- numeric drift: float reassociation (batched kernels, other reduction orders): the logprobs
  before the flip agree within tolerance and the new token was, in the solo run, within the drift
  bound of the top token's logprob. Never by rank: in bf16 several tokens share one logprob and
  their order is arbitrary, so a flip to a token tied with the top (rank 2, 3 or 5) is drift;
- isolation: a foreign canary, or a flip at a clear margin, or logprobs that moved beyond what
  float noise does — the request saw context that is not its own.

The drift bound is the configured tolerance, tightened to the batching drift the server was
measured to show (a float32 server cannot call a 0.05 nat flip drift), and never below the
logprob resolution its answers show (ties among top-k logprobs: a coarse dtype such as bf16).

Without logprobs a flip's margin is unknown: such a divergence is `unclassified`, never guessed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpage.audit.compare import Divergence
from kvpage.audit.completion import END, Completion
from kvpage.audit.config import Tolerances

NOISE, DRIFT, ISOLATION, UNCLASSIFIED = "noise", "numeric_drift", "isolation", "unclassified"

# suite verdicts
CLEAN, DRIFT_ONLY, FAILED = "clean", "numeric drift", "isolation failure"
INCONCLUSIVE = "inconclusive"
SERVER_ERRORS = "server errors"  # requests failed (5xx) under sharing or concurrency
SERVER_FAILED = "server failed"  # the server stopped answering (crashed, hung) mid-suite

# Once the batch suite has measured how far the server's logprobs move under batching alone
# (`drift_scale`), drift is bounded by that scale times DRIFT_FACTOR (never below DRIFT_FLOOR,
# never above the configured tolerances): a float32 server whose batches move logprobs by 1e-6
# does not get to call a 0.05 change "drift".
DRIFT_FACTOR = 10.0
DRIFT_FLOOR = 1e-3
# A measured resolution above this is not a dtype's rounding (bf16 near logits of 30 is 0.125):
# it never widens the bounds further.
MAX_RESOLUTION = 0.125
# A rounded logit moves by one step under reassociation, and the normaliser (logsumexp) by up to
# one more: a logprob may move by two steps without any change of context. (Clean bf16 vLLM:
# |Δ logprob| 0.015626 at a resolution of 0.015625, under the pressure round's large batches.)
RESOLUTION_STEPS = 2


@dataclass(slots=True)
class Noise:
    """The server's run-to-run noise, from the baseline suite (identical requests, alone)."""

    measured: bool = False
    token_flips: int = 0  # baseline pairs whose tokens differed
    logprob_spread: float = 0.0  # max |Δ logprob| between identical solo runs
    flip_gaps: list[float] = field(default_factory=list)  # solo margin of the new token at flips
    drift_scale: float | None = None  # max |Δ logprob| under batching alone (batch suite)
    resolution: float = 0.0  # logprob quantum of the server's dtype (0: finer than we can see)

    @property
    def flip_gap_bound(self) -> float:
        return max(self.flip_gaps, default=0.0)


def effective(tol: Tolerances, noise: Noise) -> Tolerances:
    """The tolerances, tightened to the server's measured batching drift where known, and never
    below its logprob resolution (one quantum of its dtype is not evidence of anything)."""
    if noise.drift_scale is not None:
        bound = max(DRIFT_FACTOR * noise.drift_scale, DRIFT_FLOOR)
        tol = Tolerances(tol.exact, min(tol.logprob, bound), min(tol.gap, bound))
    res = min(RESOLUTION_STEPS * noise.resolution, MAX_RESOLUTION)
    return Tolerances(tol.exact, max(tol.logprob, res), max(tol.gap, res))


def bound_rule(tol: Tolerances, noise: Noise) -> str:
    """Where the drift bounds come from, said beside every verdict that uses them."""
    eff = effective(tol, noise)
    parts = [f"tolerance {tol.gap:g}"]
    if noise.drift_scale is not None:
        parts.append(f"{DRIFT_FACTOR:g} x batching drift {noise.drift_scale:.3g}")
    rule = f"bound {eff.gap:.3g} = min({', '.join(parts)})"
    if noise.resolution:
        steps = min(RESOLUTION_STEPS * noise.resolution, MAX_RESOLUTION)
        rule += (
            f", at least {RESOLUTION_STEPS} steps of the logprob resolution "
            f"{noise.resolution:.3g} ({steps:.3g})"
        )
    return rule


MIN_TIED_POSITIONS = 2  # positions with tied top-k logprobs that show a coarse dtype


def logprob_resolution(answers: list[Completion]) -> float:
    """The quantum of the server's logprobs, read from its answers: where distinct tokens tie
    exactly in a top-k list (bf16 logits: 8 mantissa bits), the smallest nonzero step between
    neighbouring top-k logprobs is one quantum. 0 when ties are not seen (float32: no evidence of
    any rounding coarser than the tolerances)."""
    tied, steps = 0, []
    for answer in answers:
        for i in range(len(answer.top or [])):
            values = [lp for _, lp in answer.top_at(i) if math.isfinite(lp)]
            diffs = [a - b for a, b in zip(values, values[1:], strict=False)]
            tied += any(d == 0 for d in diffs)
            steps += [d for d in diffs if d > 0]
    if tied < MIN_TIED_POSITIONS or not steps:
        return 0.0
    return min(steps)


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
    prior, margin = div.prior_delta, div.cand_margin
    if div.ref_gap is None or prior is None:
        if noise.token_flips:
            return Classification(NOISE, "the server flips tokens run to run (no logprobs)")
        return Classification(
            UNCLASSIFIED, "no logprobs: the flip's margin is unknown (baseline was exact)"
        )
    if END in (div.cand_token, div.ref_token):  # one answer stopped: its margin is the gap
        margin = div.ref_gap
    if (
        noise.token_flips
        and margin is not None
        and margin <= noise.flip_gap_bound
        and prior <= noise.logprob_spread
    ):
        return Classification(
            NOISE, f"flip at solo margin {margin:.3g}, within the baseline's own flips"
        )
    rule = bound_rule(tol, noise)
    tol = effective(tol, noise)
    if prior <= tol.logprob and margin is not None and margin <= tol.gap:
        what = "a tie with the solo top" if margin == 0 else f"{margin:.3g} below the solo top"
        return Classification(
            DRIFT,
            f"near-tie flip: the new token was {what} (drift {rule}); "
            f"earlier logprobs within {prior:.3g}",
        )
    return Classification(ISOLATION, _margin_reason(div, prior, margin, tol, rule))


def _margin_reason(
    div: Divergence, prior: float, margin: float | None, tol: Tolerances, rule: str
) -> str:
    if prior > tol.logprob:
        return f"logprobs before the flip already differed by {prior:.3g} > {tol.logprob:.3g}"
    if margin is None:
        low = div.margin_floor
        return (
            f"the new token is outside the solo top-k (at least {low:.3g} below the solo top): "
            f"beyond drift ({rule})"
        )
    return (
        f"flip at a clear margin: the new token was {margin:.3g} below the solo top > drift {rule}"
    )


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
