"""The attribution classes added for the gate's power, on hand-made traces: a token chosen
differently from identical logits is the sampler's; a request that runs longer or shorter, or
ends for another reason, is a stop rule; each class lists its fields and fails when one is
missing."""

from __future__ import annotations

from kvpage.sampling_params import SamplingParams
from kvpage.verify.diff import REQUIRED_FIELDS, RequestContext, first_divergence

from .test_diff import PROMPT, TOKENS, _logits, _trace

SAMPLED = SamplingParams(temperature=0.8, top_k=3, top_p=0.9, max_tokens=5, seed=7)
SAMPLER = {"seed": 7, "generator_offset": 3, "generator_state": "00ff"}


def test_same_logits_other_token_is_sampling_with_every_field():
    ref = _trace(TOKENS, False, PROMPT, {2: {"sampler": SAMPLER}})
    # Step 2 feeds the same inputs and gets the same logits (hot token 9) but draws 4.
    cand = _trace([7, 8, 4, 1, 2], True, PROMPT, {2: {"logits": _logits(9), "sampler": SAMPLER}})
    d = first_divergence(ref, cand, context=RequestContext(SAMPLED))
    assert (d.step, d.kind, d.max_abs_logit_diff) == (2, "token", 0.0)
    a = d.attribution
    assert a.cls == "sampling" and a.complete, a.missing
    assert a.fields["seed"] == 7 and a.fields["generator_offset"] == 3
    assert a.fields["generator_state"] == "00ff"
    assert (a.fields["temperature"], a.fields["top_k"], a.fields["top_p"]) == (0.8, 3, 0.9)
    support = a.fields["support"]
    assert support["ids"][0] == 9 and support["size"] <= 3  # top-k 3 around the hot token
    assert a.fields["reference_token"] == 9 and a.fields["candidate_token"] == 4


def test_sampling_class_without_generator_state_is_incomplete():
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace([7, 8, 4, 1, 2], True, PROMPT, {2: {"logits": _logits(9)}})
    a = first_divergence(ref, cand, context=RequestContext(SAMPLED)).attribution
    assert a.cls == "sampling" and not a.complete
    assert set(a.missing) == {"seed", "generator_offset", "generator_state"}


def test_logits_that_differ_keep_the_cache_classes():
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace([7, 8, 9, 3, 2], True, PROMPT)  # step 3: logits hot at 3, not at 1
    a = first_divergence(ref, cand, context=RequestContext(SAMPLED)).attribution
    assert a.cls == "block_table"


def test_candidate_running_longer_is_a_stop_rule():
    params = SamplingParams(max_tokens=5, stop_token_ids=(9,))
    ref = _trace(TOKENS[:3], False, PROMPT)  # stopped on 9
    cand = _trace(TOKENS, True, PROMPT)  # ran on to max_tokens
    context = RequestContext(params, "stop", "length", (9, 257))
    d = first_divergence(ref, cand, context=context)
    assert (d.step, d.kind) == (3, "length")
    a = d.attribution
    assert a.cls == "stop_rule" and a.complete, a.missing
    assert a.fields["steps_ref"] == 3 and a.fields["steps_cand"] == 5
    assert a.fields["last_token"] == 9 and a.fields["stop_token_ids"] == [9, 257]
    assert a.fields["finish_reason_ref"] == "stop" and a.fields["finish_reason_cand"] == "length"
    assert a.fields["max_tokens"] == 5
    assert d.reference is ref[-1] and d.candidate is cand[3]


def test_same_tokens_other_finish_reason():
    ref, cand = _trace(TOKENS, False, PROMPT), _trace(TOKENS, True, PROMPT)
    params = SamplingParams(max_tokens=5, stop_token_ids=(2,))
    d = first_divergence(ref, cand, context=RequestContext(params, "stop", "length", (2,)))
    assert (d.kind, d.attribution.cls) == ("finish_reason", "stop_rule")
    assert first_divergence(ref, cand, context=RequestContext(params, "stop", "stop", (2,))) is None


def test_stop_rule_without_context_is_incomplete():
    d = first_divergence(_trace(TOKENS, False, PROMPT), _trace(TOKENS[:2], True, PROMPT))
    assert d.attribution.cls == "stop_rule" and not d.attribution.complete
    assert set(d.attribution.missing) == {
        "finish_reason_ref",
        "finish_reason_cand",
        "stop_token_ids",
        "max_tokens",
    }
    assert set(d.attribution.missing) <= set(REQUIRED_FIELDS["stop_rule"])
