"""First divergence of a candidate output from its reference (the same prompt, alone and cold),
with the evidence a reader needs to judge it: position, both tokens, both top-k lists, the top-2
logprob gap at that position, and how far the logprobs before it had drifted."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpage.audit.completion import END, Completion


@dataclass(slots=True)
class Divergence:
    index: int  # output position (token, or character when the server gives no tokens)
    unit: str  # "token" or "char"
    ref_token: str
    cand_token: str
    ref_top: list[tuple[str, float]] = field(default_factory=list)
    cand_top: list[tuple[str, float]] = field(default_factory=list)
    ref_gap: float | None = None  # top-1 minus top-2 logprob of the reference at `index`
    cand_gap: float | None = None
    prior_delta: float | None = None  # max |Δ chosen logprob| over positions before `index`
    logprob_only: bool = False  # same tokens throughout; only logprobs differ (by prior_delta)

    @property
    def cand_rank_in_ref(self) -> int | None:
        """1-based rank of the candidate's token in the reference's top-k (None: not in it)."""
        for rank, (token, _) in enumerate(self.ref_top, 1):
            if token == self.cand_token:
                return rank
        return None

    @property
    def cand_margin(self) -> float | None:
        """How far below the solo top the new token was in the solo run: top-1 logprob minus
        the new token's (0: a tie). None when the new token is not in the solo top-k."""
        if not self.ref_top:
            return None
        top = self.ref_top[0][1]
        return next((top - lp for token, lp in self.ref_top if token == self.cand_token), None)

    @property
    def margin_floor(self) -> float:
        """A token outside the solo top-k is at least this far below the top."""
        return self.ref_top[0][1] - self.ref_top[-1][1] if self.ref_top else 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["cand_rank_in_ref"] = self.cand_rank_in_ref
        data["cand_margin"] = self.cand_margin
        return data


def max_logprob_delta(ref: Completion, cand: Completion, upto: int | None = None) -> float | None:
    """Largest |Δ| between the chosen tokens' logprobs over the first `upto` positions."""
    if ref.logprobs is None or cand.logprobs is None:
        return None
    n = min(len(ref.logprobs), len(cand.logprobs))
    n = n if upto is None else min(n, upto)
    deltas = [abs(a - b) for a, b in zip(ref.logprobs[:n], cand.logprobs[:n], strict=True)]
    deltas = [d for d in deltas if not math.isnan(d)]
    return max(deltas, default=0.0)


def first_divergence(ref: Completion, cand: Completion, exact: float) -> Divergence | None:
    """None when the outputs agree token for token and logprob for logprob (within `exact`)."""
    unit, a = ref.units()
    _, b = cand.units()
    index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if index is None and len(a) != len(b):
        index = min(len(a), len(b))
    if index is not None:
        return _at(ref, cand, index, unit)
    delta = max_logprob_delta(ref, cand)
    if delta is None or delta <= exact:
        return None
    where = _argmax_delta(ref, cand)
    div = _at(ref, cand, where, unit)
    div.logprob_only, div.prior_delta = True, delta
    return div


def _at(ref: Completion, cand: Completion, index: int, unit: str) -> Divergence:
    return Divergence(
        index=index,
        unit=unit,
        ref_token=ref.token_text(index) if index < len(ref.units()[1]) else END,
        cand_token=cand.token_text(index) if index < len(cand.units()[1]) else END,
        ref_top=ref.top_at(index),
        cand_top=cand.top_at(index),
        ref_gap=ref.gap_at(index),
        cand_gap=cand.gap_at(index),
        prior_delta=max_logprob_delta(ref, cand, upto=index),
    )


def _argmax_delta(ref: Completion, cand: Completion) -> int:
    pairs = list(zip(ref.logprobs or [], cand.logprobs or [], strict=False))
    return max(range(len(pairs)), key=lambda i: abs(pairs[i][0] - pairs[i][1]), default=0)
