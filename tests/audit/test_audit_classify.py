"""The classifier on synthetic answers: each class is reached for the reason it names, and a
difference is never called noise or drift when it is larger than what the server's own
baseline and batching show."""

from __future__ import annotations

from kvpage.audit.classify import (
    DRIFT,
    ISOLATION,
    NOISE,
    UNCLASSIFIED,
    Noise,
    classify,
    logprob_resolution,
    suite_verdict,
)
from kvpage.audit.compare import first_divergence
from kvpage.audit.completion import END, Completion, merge_chunks, parse_body
from kvpage.audit.config import Tolerances

TOL = Tolerances()


def answer(tokens: list[str], top: list[dict[str, float]] | None = None) -> Completion:
    """Greedy output: each token is its position's most likely one."""
    if top is None:
        top = [{t: -0.5, "zz": -1.5} for t in tokens]
    lps = [max(t.values()) for t in top]
    return Completion("".join(tokens), "length", tokens=list(tokens), logprobs=lps, top=top)


def test_identical_answers_do_not_diverge():
    a = answer(["a", "b", "c"])
    assert first_divergence(a, answer(["a", "b", "c"]), TOL.exact) is None


def test_bit_level_logprob_noise_is_not_a_divergence():
    a = answer(["a", "b"])
    b = answer(["a", "b"], [{"a": -0.5 + 1e-6, "zz": -1.5}, {"b": -0.5, "zz": -1.5}])
    assert first_divergence(a, b, TOL.exact) is None


def test_near_tie_flip_to_runner_up_is_numeric_drift():
    ref = answer(["a", "b", "c"], [{"a": -0.5}, {"b": -0.70, "x": -0.72}, {"c": -0.1}])
    cand = answer(["a", "x", "c"], [{"a": -0.5}, {"x": -0.71, "b": -0.71}, {"c": -0.1}])
    div = first_divergence(ref, cand, TOL.exact)
    assert (div.index, div.ref_token, div.cand_token) == (1, "b", "x")
    assert div.cand_rank_in_ref == 2 and abs(div.ref_gap - 0.02) < 1e-9
    assert classify(div, Noise(measured=True), TOL).klass == DRIFT


def test_flip_at_a_clear_margin_is_isolation():
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -0.2, "x": -2.0}])
    cand = answer(["a", "x"], [{"a": -0.5}, {"x": -0.3, "b": -1.9}])
    verdict = classify(first_divergence(ref, cand, TOL.exact), Noise(measured=True), TOL)
    assert verdict.klass == ISOLATION and "clear margin" in verdict.reason


def test_logprobs_drifting_before_the_flip_is_isolation():
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -0.70, "x": -0.72}])
    cand = answer(["a", "x"], [{"a": -1.4}, {"x": -0.71, "b": -0.71}])
    verdict = classify(first_divergence(ref, cand, TOL.exact), Noise(measured=True), TOL)
    assert verdict.klass == ISOLATION and "before the flip" in verdict.reason


def test_a_flip_to_a_token_outside_the_top_k_is_isolation():
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -0.70, "x": -0.72}])
    cand = answer(["a", "q"], [{"a": -0.5}, {"q": -0.6, "b": -0.7}])
    verdict = classify(first_divergence(ref, cand, TOL.exact), Noise(measured=True), TOL)
    assert verdict.klass == ISOLATION and "outside the solo top-k" in verdict.reason


def test_logprob_only_changes_by_size():
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -0.5}])
    small = answer(["a", "b"], [{"a": -0.5}, {"b": -0.52}])
    large = answer(["a", "b"], [{"a": -0.5}, {"b": -0.9}])
    div_small = first_divergence(ref, small, TOL.exact)
    assert div_small.logprob_only and div_small.index == 1
    assert classify(div_small, Noise(measured=True), TOL).klass == DRIFT
    assert classify(div_small, Noise(measured=True, logprob_spread=0.05), TOL).klass == NOISE
    assert classify(first_divergence(ref, large, TOL.exact), Noise(), TOL).klass == ISOLATION


def test_batching_drift_scale_tightens_what_counts_as_drift():
    """A float32 server whose batches move logprobs by 1e-6 cannot call 0.02 "drift"."""
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -0.5}])
    cand = answer(["a", "b"], [{"a": -0.5}, {"b": -0.52}])
    div = first_divergence(ref, cand, TOL.exact)
    assert classify(div, Noise(measured=True, drift_scale=0.01), TOL).klass == DRIFT
    assert classify(div, Noise(measured=True, drift_scale=1e-6), TOL).klass == ISOLATION


def test_foreign_canary_is_isolation_whatever_the_margin():
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -0.70, "x": -0.72}])
    cand = answer(["a", "x"], [{"a": -0.5}, {"x": -0.71, "b": -0.71}])
    div = first_divergence(ref, cand, TOL.exact)
    verdict = classify(div, Noise(), TOL, foreign_canary="QX7 of g0/r1")
    assert verdict.klass == ISOLATION and "QX7" in verdict.reason


def test_without_logprobs_a_flip_is_unclassified_unless_the_server_flips_alone():
    ref, cand = Completion("abcd"), Completion("abXd")
    div = first_divergence(ref, cand, TOL.exact)
    assert (div.unit, div.index) == ("char", 2)
    assert classify(div, Noise(measured=True), TOL).klass == UNCLASSIFIED
    assert classify(div, Noise(measured=True, token_flips=1), TOL).klass == NOISE


def test_baseline_flips_bound_what_is_noise():
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -0.70, "x": -0.75}])
    cand = answer(["a", "x"], [{"a": -0.5}, {"x": -0.72, "b": -0.72}])
    div = first_divergence(ref, cand, TOL.exact)
    noisy = Noise(measured=True, token_flips=2, logprob_spread=0.01, flip_gaps=[0.08])
    assert classify(div, noisy, TOL).klass == NOISE
    tight = Noise(measured=True, token_flips=2, logprob_spread=0.01, flip_gaps=[0.01])
    assert classify(div, tight, TOL).klass == DRIFT  # beyond the baseline's flips: not noise


def test_an_answer_that_stops_early_diverges_at_its_end():
    ref, cand = answer(["a", "b", "c"]), answer(["a", "b"])
    div = first_divergence(ref, cand, TOL.exact)
    assert (div.index, div.ref_token, div.cand_token) == (2, "c", END)


def test_suite_verdict_takes_the_worst_class():
    assert suite_verdict([]) == "clean"
    assert suite_verdict([NOISE]) == "clean"
    assert suite_verdict([NOISE, DRIFT]) == "numeric drift"
    assert suite_verdict([DRIFT, UNCLASSIFIED]) == "inconclusive"
    assert suite_verdict([DRIFT], server_errors=1) == "server errors"
    assert suite_verdict([DRIFT, ISOLATION, UNCLASSIFIED], server_errors=1) == "isolation failure"


def test_parsing_completion_and_chat_bodies_and_streams():
    body = {
        "choices": [
            {
                "text": "hi",
                "finish_reason": "length",
                "token_ids": [5, 6],
                "logprobs": {
                    "tokens": ["h", "i"],
                    "token_logprobs": [-0.1, -0.2],
                    "top_logprobs": [{"h": -0.1, "x": -2.0}, {"i": -0.2}],
                },
            }
        ],
        "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}},
    }
    out = parse_body(body, chat=False)
    assert (out.text, out.token_ids, out.tokens, out.cached_tokens) == ("hi", [5, 6], ["h", "i"], 4)
    assert out.gap_at(0) == 1.9
    chat = {
        "choices": [
            {
                "message": {"content": "ok"},
                "logprobs": {
                    "content": [
                        {
                            "token": "ok",
                            "logprob": -0.3,
                            "top_logprobs": [{"token": "ok", "logprob": -0.3}],
                        }
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": 3},
    }
    parsed = parse_body(chat, chat=True)
    assert (parsed.text, parsed.tokens, parsed.cached_tokens) == ("ok", ["ok"], None)
    chunks = [
        {
            "choices": [
                {
                    "text": "h",
                    "token_ids": [5],
                    "logprobs": {
                        "tokens": ["h"],
                        "token_logprobs": [-0.1],
                        "top_logprobs": [{"h": -0.1}],
                    },
                }
            ]
        },
        {
            "choices": [
                {
                    "text": "i",
                    "token_ids": [6],
                    "finish_reason": "length",
                    "logprobs": {
                        "tokens": ["i"],
                        "token_logprobs": [-0.2],
                        "top_logprobs": [{"i": -0.2}],
                    },
                }
            ]
        },
        {
            "choices": [],
            "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}},
        },
    ]
    merged = merge_chunks(chunks, chat=False)
    assert (merged.text, merged.token_ids, merged.logprobs) == ("hi", [5, 6], [-0.1, -0.2])
    assert (merged.finish_reason, merged.cached_tokens) == ("length", 0)


def test_a_cache_hit_under_fresh_salts_is_isolation_even_at_a_near_tie():
    from kvpage.audit.capabilities import Capabilities
    from kvpage.audit.config import AuditConfig
    from kvpage.audit.probes import PromptFactory
    from kvpage.audit.suites.base import SuiteContext

    cfg = AuditConfig(base_url="http://127.0.0.1:1", model="m", progress=False)
    ctx = SuiteContext(cfg, Capabilities(cache_salt=True), None, PromptFactory(0, (3, 250)))
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -0.70, "x": -0.72}])
    cand = answer(["a", "x"], [{"a": -0.5}, {"x": -0.71, "b": -0.71}])
    ref.cached_tokens, cand.cached_tokens = 0, 16
    assert ctx.judge("s", "p", ref, cand, {}).klass == DRIFT
    check = ctx.judge("s", "p", ref, cand, {}, both_cold=True)
    assert check.klass == ISOLATION and "fresh cache salt" in check.reason
    assert check.evidence() == {}  # no prompt length reported: no absolute position


# --- ties: bf16 logprobs tie; the order among tied tokens is arbitrary -------------
def bf16_tie() -> tuple[Completion, Completion]:
    """The evidence of clean bf16 vLLM's false positives: the solo run's top three share one
    logprob, and the batched run picked the third of them."""
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -1.5, "x": -1.5, "q": -1.5, "r": -1.5625}])
    cand = answer(["a", "q"], [{"a": -0.5}, {"q": -1.5, "b": -1.5, "x": -1.5, "r": -1.5625}])
    return ref, cand


def test_a_flip_to_a_token_tied_with_the_top_is_drift_whatever_its_rank():
    ref, cand = bf16_tie()
    div = first_divergence(ref, cand, TOL.exact)
    assert div.cand_margin == 0.0
    verdict = classify(div, Noise(measured=True), TOL)
    assert verdict.klass == DRIFT and "tie with the solo top" in verdict.reason
    # the same tie under the tightest batching bound: a tie is never evidence
    assert classify(div, Noise(measured=True, drift_scale=1e-7), TOL).klass == DRIFT


def test_a_third_ranked_token_at_a_clear_margin_is_isolation():
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -0.10, "x": -0.12, "q": -0.9}])
    cand = answer(["a", "q"], [{"a": -0.5}, {"q": -0.2, "b": -0.8}])
    verdict = classify(first_divergence(ref, cand, TOL.exact), Noise(measured=True), TOL)
    assert verdict.klass == ISOLATION and "clear margin" in verdict.reason
    assert "0.8 below the solo top" in verdict.reason and "bound 0.1" in verdict.reason


def test_resolution_is_read_from_ties_and_widens_the_bound_to_one_step():
    ref, cand = bf16_tie()
    assert logprob_resolution([ref]) == 0.0  # one tied position is not enough evidence
    steps = answer(["c", "d"], [{"c": -1.0, "y": -1.0, "z": -1.03125}, {"d": -2.0, "w": -2.0}])
    assert logprob_resolution([ref, steps]) == 0.03125
    fp32 = answer(["c", "d"], [{"c": -1.0, "y": -1.0001}, {"d": -2.0, "w": -2.3}])
    assert logprob_resolution([fp32, fp32]) == 0.0
    one_step = answer(["a", "b"], [{"a": -0.5}, {"b": -1.5, "x": -1.5625}])  # two steps below
    flipped = answer(["a", "x"], [{"a": -0.5}, {"x": -1.5, "b": -1.5}])
    div = first_divergence(one_step, flipped, TOL.exact)
    tight = Noise(measured=True, drift_scale=1e-5)  # bound 1e-3: a float32-like batch drift
    assert classify(div, tight, TOL).klass == ISOLATION
    coarse = Noise(measured=True, drift_scale=1e-5, resolution=0.03125)
    verdict = classify(div, coarse, TOL)
    assert verdict.klass == DRIFT and "resolution 0.0312 (0.0625)" in verdict.reason
    three = answer(["a", "b"], [{"a": -0.5}, {"b": -1.5, "x": -1.59375}])
    div = first_divergence(three, flipped, TOL.exact)
    assert classify(div, coarse, TOL).klass == ISOLATION  # three steps: not rounding


def test_a_logprob_moving_by_a_step_and_a_bit_is_drift_at_that_resolution():
    """The clean bf16 vLLM false positive: same tokens, |Δ| just over one step (0.015625)."""
    ref = answer(["a", "b"], [{"a": -0.5}, {"b": -2.0}])
    cand = answer(["a", "b"], [{"a": -0.5}, {"b": -2.015626}])
    div = first_divergence(ref, cand, TOL.exact)
    tight = Noise(measured=True, drift_scale=1e-6)
    assert classify(div, tight, TOL).klass == ISOLATION  # a float32 server: 0.0156 is not drift
    coarse = Noise(measured=True, drift_scale=1e-6, resolution=0.015625)
    assert classify(div, coarse, TOL).klass == DRIFT
