"""Speculative decoding in the gate: the speculative suite passes on the real engine and does
what it is built for (drafts kept and rejected at the first and the last position, a hit on
blocks a speculating request wrote, preemption between speculative steps); each speculative
mutant is caught by it and attributed "speculative"; the rejection-rule oracle refuses
planted decisions; the sampled path's distribution test can fail."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvpage.model import load_model
from kvpage.sampling_params import SamplingParams
from kvpage.speculative.rejection import verify_drafts
from kvpage.verify.case import RequestSpec
from kvpage.verify.cases.speculative import K, speculative_cases
from kvpage.verify.gate import run_mutant
from kvpage.verify.mutants.speculative import SPECULATIVE_MUTANTS
from kvpage.verify.speculative import check_verifications
from kvpage.verify.suites import Runtime, run_case

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def runtime():
    model, tokenizer = load_model(MODEL)
    return Runtime(model, tokenizer, MODEL)


@pytest.fixture(scope="module")
def results(runtime):
    return {c.name: run_case(c, runtime) for c in speculative_cases(258)}


def test_the_suite_passes(results):
    for name, result in results.items():
        assert result.passed, (name, [f.message for f in result.failures])


def test_the_suite_speculates_keeps_and_rejects_at_the_first_and_the_last_draft(results):
    for result in results.values():
        assert result.stats["spec_decode_num_drafts"] > 0, result.case
    stats = [r.stats for r in results.values()]
    # Draft i kept implies drafts 0..i-1 kept: a verification that rejected its first draft
    # adds to num_drafts but not to pos_0, one that rejected its last to pos_{k-2} only.
    first = sum(
        s["spec_decode_num_drafts"] - s["spec_decode_num_accepted_tokens_pos_0"] for s in stats
    )
    last_pos, before_last = (
        f"spec_decode_num_accepted_tokens_pos_{K - 1}",
        f"spec_decode_num_accepted_tokens_pos_{K - 2}",
    )
    last = sum(s[before_last] - s[last_pos] for s in stats)
    kept_all = sum(s[last_pos] for s in stats)
    assert first > 0 and last > 0 and kept_all > 0, (first, last, kept_all)


def test_preemption_happens_between_speculative_steps(results):
    for mode in ("swap", "recompute"):
        stats = results[f"preempted_mid_speculation_{mode}"].stats
        assert stats["preemptions"] >= 4 and stats["spec_decode_num_accepted_tokens"] > 0, stats


@pytest.mark.parametrize("mutant", SPECULATIVE_MUTANTS, ids=lambda m: m.name)
def test_each_speculative_mutant_is_caught_and_attributed(mutant, runtime):
    cases = speculative_cases(runtime.model.config.vocab_size)
    result = run_mutant(mutant, runtime.model, runtime.tokenizer, MODEL, cases, runtime)
    assert result.caught and result.caught_by[0].startswith("speculative/"), result.first_failure
    attribution = result.divergence["attribution"]
    assert attribution["class"] == "speculative" and attribution["missing"] == [], attribution


# --- the rejection-rule oracle on its own ------------------------------------------------------
def _tracer(verifications, records):
    """What check_verifications reads of a tracer: its verifications, records and method."""
    config = SimpleNamespace(method="draft_model")
    engine = SimpleNamespace(speculation=SimpleNamespace(config=config))
    return SimpleNamespace(verifications=verifications, records=records, engine=engine)


def _one_verification(seed: int, planted=None):
    """A sampled verification of 3 drafts from q, and reference records whose logits are the
    same rows: the oracle must find nothing, unless `planted` rewrote a decision."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 12, generator=gen) * 2
    q = torch.softmax(torch.randn(3, 12, generator=gen), dim=-1)
    drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(3)]
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
    v = verify_drafts(logits, drafts, params, torch.Generator().manual_seed(seed), q)
    if planted is not None:
        v = planted(v)
    records = [SimpleNamespace(logits=logits[i], speculative=None) for i in range(4)]
    case = SimpleNamespace(requests=[RequestSpec("r", [1, 2], params)])
    return case, _tracer({"r": [(0, v)]}, {"r": records}), {"r": records}


def test_the_rejection_oracle_passes_the_rule_and_refuses_planted_decisions():
    for seed in range(20):
        assert check_verifications(*_one_verification(seed)) == []

    def unclamped(v):
        d = v.draws
        p_x = d.target_probs[torch.arange(3), torch.tensor(v.draft_tokens)]
        q_x = d.draft_probs[torch.arange(3), torch.tensor(v.draft_tokens)]
        return replace(v, draws=replace(d, accept_probs=p_x / q_x))

    def from_p(v):
        if v.num_accepted == 3:
            return v
        return replace(v, draws=replace(v.draws, final_probs=v.draws.target_probs[v.num_accepted]))

    def extra_token(v):
        return replace(v, tokens=[*v.tokens, v.tokens[-1]])

    for planted in (unclamped, from_p, extra_token):
        caught = [check_verifications(*_one_verification(s, planted)) for s in range(20)]
        assert any(caught), planted.__name__
        found = next(f for f in caught if f)[0]
        assert found.divergence.attribution.cls == "speculative", found.message
