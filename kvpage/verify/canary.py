"""Canaries: each request carries its own short token sequence in its private tail. A foreign
canary in another request's output tokens or top-k is an isolation failure naming both requests.
Appearances the reference also shows (the request alone, so it cannot have seen a foreign canary)
are the model's own doing and are not counted."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvpage.reference.records import StepRecord

CANARY_LEN = 3
TOPK_MARGIN = 1e-3


@dataclass(frozen=True, slots=True)
class IsolationFailure:
    victim: str  # request whose output carries the canary
    source: str  # request the canary belongs to
    where: str  # "output" or "topk@<step>"

    def __str__(self) -> str:
        return f"canary of {self.source} found in {self.victim}'s {self.where}"


def make_canaries(
    request_ids: list[str], vocab: list[int], seed: int
) -> dict[str, tuple[int, ...]]:
    """Distinct canaries, and distinct leading tokens so top-k hits name one source."""
    rng = random.Random(seed)
    leads = rng.sample(vocab, len(request_ids))
    return {
        rid: (lead, *rng.choices(vocab, k=CANARY_LEN - 1))
        for rid, lead in zip(request_ids, leads, strict=True)
    }


def find_foreign_canaries(
    canaries: dict[str, tuple[int, ...]],
    candidate: dict[str, list[StepRecord]],
    reference: dict[str, list[StepRecord]],
    margin: float = TOPK_MARGIN,
) -> list[IsolationFailure]:
    """`margin`: how far above the reference a foreign canary's logit must be to count (at
    least the run's logit tolerance: 16-bit models drift more than float32 kernels)."""
    failures: list[IsolationFailure] = []
    for victim, records in candidate.items():
        ref_records = reference.get(victim, [])
        own = canaries.get(victim)
        for source, canary in canaries.items():
            if source == victim or canary == own:
                continue
            failures += _in_output(victim, source, canary, records, ref_records)
            failures += _in_topk(victim, source, canary[0], records, ref_records, margin)
    return failures


def _in_output(victim, source, canary, records, ref_records) -> list[IsolationFailure]:
    tokens = [r.chosen_token for r in records]
    ref_tokens = [r.chosen_token for r in ref_records]
    if _contains(tokens, canary) and not _contains(ref_tokens, canary):
        return [IsolationFailure(victim, source, "output")]
    return []


def _in_topk(victim, source, lead, records, ref_records, margin) -> list[IsolationFailure]:
    for step, rec in enumerate(records):
        ref = ref_records[step] if step < len(ref_records) else None
        if lead not in rec.topk_ids or (ref is not None and lead in ref.topk_ids):
            continue
        # A rank-5 near-tie can swap on kernel rounding; a leak moves the logit for real.
        if ref is None or _logit(rec, lead) - _logit(ref, lead) > margin:
            return [IsolationFailure(victim, source, f"topk@{step}")]
    return []


def _logit(rec: StepRecord, token: int) -> float:
    return float(rec.logits[token]) if rec.logits is not None else float("inf")


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    n = len(sub)
    return any(tuple(seq[i : i + n]) == sub for i in range(len(seq) - n + 1))
