"""The sampling oracle on tied logits (16-bit models: one bfloat16 logit value is shared by many
tokens). Which tokens of a tie group straddling the top-p cut are kept depends on how the sort
orders them, so the oracle accepts any member of that group, yet still rejects a draw below it;
the uniformity test counts the group as one outcome."""

from __future__ import annotations

import pytest
import torch

import kvpage.sampling as shared
from kvpage import SamplingParams
from kvpage.verify.mutants.sampling import probs_top_p_before_temperature, race_draw
from kvpage.verify.sampling_oracle import (
    SAMPLING_P_THRESHOLD,
    DrawSample,
    check_draw,
    oracle_probs,
    uniformity_test,
)

# Sorted: token 0 (3.0), then tokens 1, 2, 3 tied at 2.0, then token 4 (1.0), token 5 (0.0).
TIED = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])


def _p(top_p: float, top_k: int = -1, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1)


def test_a_tie_group_straddling_the_top_p_cut():
    e = torch.exp(TIED.double() - 3.0)
    p0, p1 = float(e[0] / e.sum()), float(e[1] / e.sum())
    top_p = p0 + 1.5 * p1  # the cut falls inside the group: two of the three tied tokens stay
    kept = oracle_probs(TIED, 1.0, -1, top_p)
    assert (kept > 0).tolist() == [True, True, True, False, False, False]  # stable: by id
    # Token 3 is kept under another order of the group (the engine's sort is not stable).
    for token in (0, 1, 2, 3):
        assert check_draw(TIED, _p(top_p), token) is None
    for token in (4, 5):  # below the group: outside the support under every order
        assert "outside the filtered support" in check_draw(TIED, _p(top_p), token)


def test_a_tie_group_wholly_past_the_cut_is_rejected():
    e = torch.exp(TIED.double() - 3.0)
    top_p = float(e[0] / e.sum()) * 0.9  # the top token alone covers top_p
    assert check_draw(TIED, _p(top_p), 0) is None
    for token in (1, 2, 3, 4):
        assert check_draw(TIED, _p(top_p), token) is not None


def test_ties_at_the_top_k_cut_and_after_it():
    # top_k=2: the 2nd value (2.0) is tied three times; all three stay (ties at the k-th).
    for token in (0, 1, 2, 3):
        assert check_draw(TIED, _p(1.0, top_k=2), token) is None
    assert check_draw(TIED, _p(1.0, top_k=2), 4) is not None
    # top-k then top-p over the renormalised top-k: the mass above token 3 is token 0's alone.
    e = torch.exp(TIED[:4].double() - 3.0)
    top_p = float(e[0] / e.sum()) + 1e-3
    assert check_draw(TIED, _p(top_p, top_k=4), 3) is None
    assert check_draw(TIED, _p(top_p, top_k=4), 4) is not None


def _bf16_battery() -> list[torch.Tensor]:
    """Logits rounded to bfloat16 (then float32, as the engine hands them to the sampler), in the
    range of the built-in models' logits: many tokens share one value."""
    g = torch.Generator().manual_seed(39)
    return [(torch.randn(258, generator=g) * 2.0).to(torch.bfloat16).float() for _ in range(40)]


CONFIGS = [(2.0, -1, 0.5), (0.9, 40, 0.95), (1.0, -1, 0.3), (2.0, 20, 0.5)]


def _draws(sample_token=None) -> list[DrawSample]:
    sample_token = sample_token or shared.sample_token
    draws = []
    for i, logits in enumerate(_bf16_battery()):
        T, top_k, top_p = CONFIGS[i % len(CONFIGS)]
        for s in range(60):
            params = SamplingParams(temperature=T, top_k=top_k, top_p=top_p, seed=100 * i + s)
            token = sample_token(logits, params, shared.make_generator(params, 0))
            draws.append(DrawSample(logits, params, token))
    return draws


def test_the_shared_sampler_on_bf16_logits_passes():
    draws = _draws()
    # The battery does exercise ties: some draws are members the stable oracle left out.
    straddled = [
        d
        for d in draws
        if oracle_probs(d.logits, d.params.temperature, d.params.top_k, d.params.top_p)[d.token]
        == 0
    ]
    assert straddled
    assert [check_draw(d.logits, d.params, d.token) for d in draws] == [None] * len(draws)
    result = uniformity_test(draws)
    assert result.passed and result.p_value > 1e-2, result


def test_a_sampler_bug_on_bf16_logits_is_still_caught():
    """Top-p applied to the untempered logits (a mutant's bug): at T=2 it keeps fewer tokens
    than the oracle, at T<1 more; the extra ones lie below the cut, not in a tie with it."""

    def broken(logits, params, gen):
        if params.greedy:
            return int(torch.argmax(logits))
        return race_draw(probs_top_p_before_temperature(logits, params), gen)

    draws = _draws(broken)
    bad = [d for d in draws if check_draw(d.logits, d.params, d.token) is not None]
    assert bad
    assert uniformity_test(draws).p_value < SAMPLING_P_THRESHOLD


@pytest.mark.parametrize("token", [4, 5])
def test_below_the_group_by_a_float32_rounding_is_still_outside(token):
    """The tie tolerance is float32 rounding of the tempered logits, not a bfloat16 step."""
    logits = TIED.clone()
    logits[4] = 2.0 - 2.0**-7  # one bfloat16 step below the group at 2.0
    e = torch.exp(TIED.double() - 3.0)
    top_p = float(e[0] / e.sum()) + 1.5 * float(e[1] / e.sum())
    assert check_draw(logits, _p(top_p), token) is not None
