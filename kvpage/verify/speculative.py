"""Speculative decoding, judged from outside (issue 44, item 5).

Greedy speculation is lossless token for token: its records diff against the contiguous
reference like any request's. A sampled speculating request cannot be diffed draw for draw (its
draws are the rejection rule's, not plain sampling's), so the reference scores the engine's own
tokens (`speculative_draws`), the diff checks the logits of every position, the sampling oracle
checks every token is drawable and that all of them together follow p (a uniformity test), and
`check_verifications` re-checks every decision of the rule against p and q:

  draft i is kept    iff u_i < min(1, p_i(x_i) / q_i(x_i))       (the recorded uniform u_i)
  after a rejection  the token is drawn from norm(max(0, p_j - q_j)), j the rejected draft
  all kept           the token is drawn from p_k (the bonus row)
  the tokens         the kept drafts, then exactly one token (none after a rejection)

p comes from the verifier's own oracle (kvpage.verify.sampling_oracle, float64) over the
reference's logits at that position; q is the proposer's distribution as recorded (a one-hot on
the draft for n-gram). This module imports neither kvpage.speculative nor kvpage.sampling.
A failure is attributed to class "speculative"."""

from __future__ import annotations

import torch

from kvpage.reference.records import StepRecord
from kvpage.verify.checks import Failure
from kvpage.verify.diff import REQUIRED_FIELDS, Attribution, Divergence
from kvpage.verify.sampling_oracle import oracle_probs

# The engine computes p in float32 from logits that may drift from the reference's by the
# run's logit tolerance: a probability within this of the oracle's is the same probability.
# A token exactly at a top-k/top-p cut may be kept by one side and not the other (the sampling
# oracle's BOUNDARY_SLACK): such a token is left out of the comparison, and the rest of the
# distribution then differs by its renormalisation, well inside this.
PROB_ATOL = 2e-3


def speculative_draws(engine, params, cand: list[StepRecord]) -> tuple[int, ...] | None:
    """The tokens a sampled request of a speculating engine drew (the reference takes them
    instead of drawing its own); None for a greedy request or a plain engine."""
    if getattr(engine, "speculation", None) is None or params.greedy:
        return None
    return tuple(rec.chosen_token for rec in cand)


def check_verifications(case, tracer, refs: dict[str, list[StepRecord]]) -> list[Failure]:
    """Every sampled verification of the case against the oracle's p and the recorded q."""
    failures = []
    for spec in case.requests:
        for sample, sample_id in enumerate(spec.sample_ids()):
            params = spec.params.for_sample(sample)
            ref = refs.get(sample_id, [])
            for first, verification in tracer.verifications.get(sample_id, ()):
                problem = _check_one(verification, ref, first, params)
                if problem is not None:
                    step, why = problem
                    div = _divergence(sample_id, step, why, verification, tracer, params)
                    failures.append(Failure("speculative", f"{sample_id}: {why}", sample_id, div))
                    break
    return failures


def _check_one(verification, ref: list[StepRecord], first: int, params):
    """(record step, problem) of the first rule the verification broke, or None."""
    drafts, tokens, kept = verification.draft_tokens, verification.tokens, verification.num_accepted
    if tokens[:kept] != list(drafts[:kept]) or len(tokens) != kept + 1:
        return first + min(kept, len(tokens) - 1), (
            f"{len(tokens)} tokens {tokens} for {kept} kept of drafts {list(drafts)}: the kept "
            f"drafts and exactly one token must follow"
        )
    draws = verification.draws
    if draws is None or first + kept >= len(ref):  # greedy: the diff judges it
        return None
    for i in range(min(kept + 1, len(drafts))):
        p = _oracle_p(ref[first + i], params)
        q = draws.draft_probs[i].double()
        x = drafts[i]
        want = 1.0 if q[x] <= 0 and p[x] > 0 else min(1.0, float(p[x] / q[x])) if q[x] > 0 else 0.0
        got = float(draws.accept_probs[i])
        at_cut = (float(draws.target_probs[i][x]) > 0) != bool(p[x] > 0)
        if abs(got - want) > PROB_ATOL and not at_cut:
            return first + i, f"draft {i} ({x}) kept with probability {got:.4g}, not {want:.4g}"
        if (float(draws.uniforms[i]) < got) != (i < kept):
            return first + i, f"draft {i}: u = {float(draws.uniforms[i]):.4g} vs {got:.4g}"
    p_final = _oracle_p(ref[first + kept], params)
    if kept < len(drafts):
        residual = (p_final - draws.draft_probs[kept].double()).clamp_min(0.0)
        want_final = residual / residual.sum() if residual.sum() > 0 else p_final
        what = f"the residual norm(max(0, p - q)) after draft {kept} was rejected"
    else:
        want_final, what = p_final, "p of the bonus row"
    final = draws.final_probs.double()
    both = (final > 0) & (want_final > 0)  # a token at the top-k/top-p cut may fall either side
    error = float((final - want_final)[both].abs().max()) if bool(both.any()) else 1.0
    if error > PROB_ATOL:
        return first + kept, f"the last token was drawn from another distribution than {what}"
    if want_final[tokens[-1]] <= 0:
        return first + kept, f"the last token {tokens[-1]} has probability 0 under {what}"
    return None


def _oracle_p(record: StepRecord, params) -> torch.Tensor:
    return oracle_probs(record.logits, params.temperature, params.top_k, params.top_p)


def _divergence(sample_id: str, step: int, why: str, verification, tracer, params) -> Divergence:
    records = tracer.records.get(sample_id, [])
    cand = records[step] if step < len(records) else None
    note = (cand.speculative if cand is not None else None) or {}
    fields = {
        **note,
        "step": step,
        "drafts": list(verification.draft_tokens),
        "num_accepted": verification.num_accepted,
        "index": note.get("index", -1),
        "method": tracer.engine.speculation.config.method,
    }
    missing = [f for f in REQUIRED_FIELDS["speculative"] if fields.get(f) is None]
    attribution = Attribution("speculative", why, fields, missing)
    return Divergence(sample_id, step, "speculative", why, None, cand, None, attribution)
