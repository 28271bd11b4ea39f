"""16-bit verification: a divergence is forgiven as a numeric tie only when every logit agrees
within the tolerance and (greedy) the two tokens were within it in the reference's own scores."""

from __future__ import annotations

import torch

from kvpage.reference.records import EMPTY_VIEW, StepRecord
from kvpage.sampling_params import SamplingParams
from kvpage.verify.diff import (
    RequestContext,
    first_divergence,
    is_numeric_tie,
    logit_atol,
    numeric_tie_step,
)

# bfloat16 compute on logits of magnitude 8: 0.25, more than any drift these records show.
ATOL = logit_atol("auto", torch.bfloat16, scale=8.0)


def _rec(step: int, logits: list[float], inputs=(5,)) -> StepRecord:
    t = torch.tensor(logits)
    return StepRecord(
        "r", step, list(inputs), [step], "", [], [], int(t.argmax()), EMPTY_VIEW, logits=t
    )


def _greedy() -> RequestContext:
    return RequestContext(SamplingParams(max_tokens=4), None, None, ())


def test_a_greedy_near_tie_within_tolerance_is_a_tie():
    ref = _rec(0, [1.0, 3.00, 2.95])
    cand = _rec(0, [1.0, 2.95, 3.00])  # drift 0.05, reference gap 0.05
    assert is_numeric_tie(ref, cand, ATOL, greedy=True)


def test_a_clear_greedy_winner_is_not_a_tie_even_with_small_drift():
    ref = _rec(0, [1.0, 3.0, 2.0, 0.0])
    cand = _rec(0, [1.0, 3.0, 2.0, 0.0])
    cand.chosen_token = 2  # chose the token the reference scored 1.0 lower: a bug
    assert not is_numeric_tie(ref, cand, ATOL, greedy=True)


def test_drift_beyond_the_tolerance_is_never_a_tie():
    ref = _rec(0, [1.0, 3.0, 2.99])
    cand = _rec(0, [1.0, 2.0, 2.99 + ATOL])  # a read of other K/V moves logits a lot
    assert not is_numeric_tie(ref, cand, ATOL, greedy=True)
    assert not is_numeric_tie(ref, cand, ATOL, greedy=False)


def test_other_inputs_are_never_a_tie():
    ref = _rec(0, [1.0, 3.0, 2.95])
    cand = _rec(0, [1.0, 2.95, 3.0], inputs=(6,))
    assert not is_numeric_tie(ref, cand, ATOL, greedy=True)


def test_a_sampled_step_within_tolerance_from_the_same_generator_state_is_a_tie():
    ref = _rec(0, [1.0, 3.0, 2.0])
    cand = _rec(0, [1.0, 3.1, 2.0])
    cand.chosen_token = 2  # a draw on the boundary the drift moved
    ref.sampler = {"seed": 7, "generator_offset": 1, "generator_state": "ab"}
    cand.sampler = dict(ref.sampler)
    assert is_numeric_tie(ref, cand, ATOL, greedy=False)
    assert not is_numeric_tie(ref, cand, ATOL, greedy=True)


def test_a_sampled_step_from_another_generator_state_is_never_a_tie():
    """A shared or re-seeded generator draws another uniform: a sampling bug, whatever the drift."""
    ref = _rec(0, [1.0, 3.0, 2.0])
    cand = _rec(0, [1.0, 3.0, 2.0])
    cand.chosen_token = 2
    ref.sampler = {"seed": 7, "generator_offset": 1, "generator_state": "ab"}
    cand.sampler = {"seed": 7, "generator_offset": 1, "generator_state": "cd"}
    assert not is_numeric_tie(ref, cand, ATOL, greedy=False)
    cand.sampler = None
    assert not is_numeric_tie(ref, cand, ATOL, greedy=False)


def test_first_divergence_forgives_a_tie_only_when_allowed():
    ref = [_rec(0, [0.0, 2.0, 1.0]), _rec(1, [1.0, 3.0, 2.95]), _rec(2, [0.0, 5.0, 0.0])]
    cand = [_rec(0, [0.0, 2.0, 1.0]), _rec(1, [1.0, 2.95, 3.0]), _rec(2, [9.0, 0.0, 0.0])]
    strict = first_divergence(ref, cand, ATOL, _greedy())
    assert strict is not None and strict.step == 1 and strict.kind == "token"
    assert first_divergence(ref, cand, ATOL, _greedy(), ties_allowed=True) is None
    assert numeric_tie_step(ref, cand, ATOL, greedy=True) == 1


def test_a_real_divergence_before_a_tie_still_fails():
    ref = [_rec(0, [0.0, 2.0, 1.0]), _rec(1, [1.0, 3.0, 2.95])]
    cand = [_rec(0, [0.0, 1.0, 2.0]), _rec(1, [1.0, 2.95, 3.0])]  # step 0: a clear flip
    div = first_divergence(ref, cand, ATOL, _greedy(), ties_allowed=True)
    assert div is not None and div.step == 0
    assert numeric_tie_step(ref, cand, ATOL, greedy=True) is None
