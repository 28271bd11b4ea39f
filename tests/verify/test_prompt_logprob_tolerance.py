"""The prompt-logprob row check's tolerance is the logits' dtype rule (diff.logit_atol), and its
top-k set comparison allows a swap at the k-th place only between tokens the reference scores
within that tolerance of each other (16-bit ties), never a token further below."""

from __future__ import annotations

import pytest
import torch

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.model import load_model
from kvpage.verify.cases.prompt_logprobs import (
    _row_difference,
    prompt_logprob_cases,
    reference_prompt_logprobs,
    run_prompt_logprob_case,
)
from kvpage.verify.diff import logit_atol
from kvpage.verify.mutants.prompt_logprobs import PROMPT_LOGPROB_MUTANTS

MODEL = "builtin:tiny-llama"
ATOL = 0.05

# Logprobs of a 6-token vocabulary: token 0 first, tokens 1 and 2 tied (a bf16 tie), token 3
# within ATOL below them, token 4 well below, token 5 last.
EXACT = torch.log_softmax(torch.tensor([4.0, 3.0, 3.0, 3.0 - ATOL / 2, 2.0, 0.0]), dim=-1)


def _row(ids, token=5, shift=0.0):
    row = {t: float(EXACT[t]) + shift for t in ids}
    row[token] = float(EXACT[token]) + shift
    return row


WANT = _row([0, 1])  # the reference's top 2 (topk picked token 1 of the tie) and token 5


def test_a_tie_at_the_kth_place_may_swap():
    assert _row_difference(WANT, _row([0, 1]), 5, EXACT, 2, ATOL) is None
    assert _row_difference(WANT, _row([0, 2]), 5, EXACT, 2, ATOL) is None  # exact tie
    assert _row_difference(WANT, _row([0, 3]), 5, EXACT, 2, ATOL) is None  # within ATOL


def test_a_token_further_below_may_not():
    problem = _row_difference(WANT, _row([0, 4]), 5, EXACT, 2, ATOL)
    assert problem is not None and "top-k set differs" in problem[0]
    problem = _row_difference(WANT, _row([1, 2]), 5, EXACT, 2, ATOL)  # the top token left out
    assert problem is not None and "top-k set differs" in problem[0]


def test_values_within_the_tolerance_and_beyond():
    assert _row_difference(WANT, _row([0, 1], shift=0.9 * ATOL), 5, EXACT, 2, ATOL) is None
    problem = _row_difference(WANT, _row([0, 1], shift=1.1 * ATOL), 5, EXACT, 2, ATOL)
    assert problem is not None and "off by" in problem[0]


def test_row_shape():
    assert "entries" in _row_difference(WANT, _row([0, 1, 2]), 5, EXACT, 2, ATOL)[0]
    no_token = {t: float(EXACT[t]) for t in (0, 1)}
    assert "set differs" in _row_difference(WANT, no_token, 5, EXACT, 2, ATOL)[0]
    # The prompt token inside the top k: k entries, the token among them.
    inside = {t: float(EXACT[t]) for t in (0, 1)}
    assert _row_difference(inside, inside, 1, EXACT, 2, ATOL) is None


@pytest.fixture(scope="module")
def bf16():
    return load_model(MODEL, dtype=torch.bfloat16)


def test_the_tolerance_is_the_dtype_rule(bf16):
    model, _ = bf16
    prompt = list(range(3, 40))
    exact, scale = reference_prompt_logprobs(model, prompt)
    assert exact.shape == (len(prompt) - 1, model.config.vocab_size)
    assert scale > 1.0
    # bfloat16: 8 * 2^-8 * scale; the constant it replaces (1e-4) is 1/1000 of it.
    assert logit_atol("auto", model.dtype, scale) == pytest.approx(8 * 2.0**-8 * scale)


def _engine(loaded, case) -> LLMEngine:
    model, tokenizer = loaded
    config = EngineConfig(model=MODEL, dtype="bfloat16", debug_checks=True, **case.engine)
    return LLMEngine(config, model, tokenizer)


def _case(model, name: str):
    return next(c for c in prompt_logprob_cases(model.config.vocab_size) if name in c.name)


@pytest.mark.parametrize("name", ["kept rows", "chunked prefill"])
def test_an_honest_bf16_engine_passes(bf16, name):
    """The two cases whose bfloat16 rows failed a float32 constant (a 0.025 logprob drift; a
    tie at the k-th place served from kept rows)."""
    case = _case(bf16[0], name)
    assert run_prompt_logprob_case(case, _engine(bf16, case), bf16[0]) == []


def test_a_wrong_row_in_bf16_is_still_caught(bf16):
    mutant = next(m for m in PROMPT_LOGPROB_MUTANTS if m.name == "prompt_rows_offset_by_one")
    case = _case(bf16[0], "chunked prefill")
    engine = _engine(bf16, case)
    mutant.apply(engine)
    failures = run_prompt_logprob_case(case, engine, bf16[0])
    assert failures
    fields = failures[0].divergence.attribution.fields
    assert fields["atol"] < 0.5  # the rule's, at tiny-llama's logits
