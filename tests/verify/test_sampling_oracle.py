"""The independent sampling oracle (kvpage.verify.sampling_oracle): it shares no code with
kvpage.sampling, agrees with hand-computed probabilities, passes the correct sampler, and catches
bugs planted in the shared sampler — bugs the engine-vs-reference diff cannot see, since both sides
draw through the same broken code. Also: the engine-only sampling mutants drift from the
reference on a workload that exercises them."""

from __future__ import annotations

import math
import random
from typing import NamedTuple

import pytest
import torch

import kvpage.sampling as shared
from kvpage import LLM, SamplingParams
from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.model import load_model
from kvpage.verify.mutants.sampling import (
    SAMPLING_MUTANTS,
    probs_top_k_off_by_one,
    probs_top_p_before_temperature,
    race_draw,
)
from kvpage.verify.reference import generate
from kvpage.verify.sampling_oracle import (
    SAMPLING_P_THRESHOLD,
    SUPPORT_CAP,
    DrawSample,
    check_draw,
    check_logprobs,
    chi2_sf,
    describe_sampler_state,
    filtered_support,
    kolmogorov_q,
    oracle_probs,
    uniformity_test,
)
from kvpage.verify.trace import EngineTracer

from .test_reference_independence import reached_modules

MODEL = "builtin:tiny-llama"
WIDE_MARGIN = 1e-2  # the correct sampler's p-values must clear this, not just the gate threshold


# --- independence --------------------------------------------------------------------------------
def _forbidden(names: set[str]) -> list[str]:
    return sorted(
        n
        for n in names
        if n in ("kvpage.sampling", "kvpage.engine") or n.startswith("kvpage.engine.")
    )


def test_oracle_imports_neither_the_shared_sampler_nor_the_engine():
    assert _forbidden(reached_modules("kvpage.verify.sampling_oracle")) == []
    assert "kvpage.sampling" in _forbidden(reached_modules("kvpage.verify.reference"))  # the walk works


# --- exact probabilities, by hand ----------------------------------------------------------------
LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0])


def _softmax(values: dict[int, float], size: int = 5) -> list[float]:
    """Hand softmax over the kept tokens `values` (id -> tempered logit); zero elsewhere."""
    total = sum(math.exp(v) for v in values.values())
    return [math.exp(values[i]) / total if i in values else 0.0 for i in range(size)]


def _close(probs: torch.Tensor, expected: list[float]) -> None:
    assert probs.dtype == torch.float64
    assert probs.tolist() == pytest.approx(expected, abs=1e-12)


def test_oracle_probs_plain_and_tempered():
    _close(
        oracle_probs(LOGITS, 1.0, -1, 1.0), _softmax({i: float(v) for i, v in enumerate(LOGITS)})
    )
    half = {i: float(v) / 0.5 for i, v in enumerate(LOGITS)}  # T=0.5 doubles the logits
    _close(oracle_probs(LOGITS, 0.5, -1, 1.0), _softmax(half))
    _close(oracle_probs(LOGITS, 0.0, 40, 0.5), [0.0, 0.0, 0.0, 0.0, 1.0])  # greedy: argmax only


def test_oracle_probs_top_k():
    _close(oracle_probs(LOGITS, 1.0, 2, 1.0), _softmax({4: 3.0, 0: 2.0}))
    _close(oracle_probs(LOGITS, 1.0, 5, 1.0), oracle_probs(LOGITS, 1.0, -1, 1.0).tolist())
    # Ties at the k-th value all stay (tokens are masked when strictly below the k-th logit).
    _close(oracle_probs(torch.tensor([1.0, 3.0, 3.0, 0.0, 2.0]), 1.0, 1, 1.0), [0, 0.5, 0.5, 0, 0])


def test_oracle_probs_top_p_edges():
    e = [math.exp(v) for v in (3.0, 2.0, 1.0)]  # tokens 4, 0, 1 in descending order
    total = sum(math.exp(v) for v in (3.0, 2.0, 1.0, 0.0, -1.0))
    before_token1 = (e[0] + e[1]) / total  # mass strictly before the third token, ~0.8705
    _close(oracle_probs(LOGITS, 1.0, -1, before_token1 - 1e-6), _softmax({4: 3.0, 0: 2.0}))
    _close(oracle_probs(LOGITS, 1.0, -1, before_token1 + 1e-6), _softmax({4: 3.0, 0: 2.0, 1: 1.0}))
    # The top token alone exceeds top_p: it still stays, alone.
    _close(oracle_probs(torch.tensor([0.0, 0.0, 0.0, 10.0, 0.0]), 1.0, -1, 0.5), [0, 0, 0, 1, 0])
    _close(oracle_probs(LOGITS, 1.0, -1, 1.0), oracle_probs(LOGITS, 1.0, -1, 0.9999999).tolist())


def test_top_p_runs_over_the_tempered_top_k_distribution():
    """T=2, top_k=3, top_p=0.7. Tempered top-3 {4: 1.5, 0: 1.0, 1: 0.5} renormalised is
    (.5065, .3072, .1863): the mass before token 1 is .8137 >= .7, so token 1 is cut. Over the
    unfiltered tempered distribution it would be .6887 < .7 and token 1 would stay."""
    top3 = {4: 1.5, 0: 1.0, 1: 0.5}
    kept = _softmax(top3)
    assert kept[4] + kept[0] == pytest.approx(0.8137, abs=1e-4)
    _close(oracle_probs(LOGITS, 2.0, 3, 0.7), _softmax({4: 1.5, 0: 1.0}))


# --- statistics helpers against textbook values --------------------------------------------------
def test_kolmogorov_and_chi_square_tail_probabilities():
    assert kolmogorov_q(1.3581) == pytest.approx(0.05, abs=2e-4)
    assert kolmogorov_q(1.6276) == pytest.approx(0.01, abs=1e-4)
    assert kolmogorov_q(0.5) == pytest.approx(0.9639, abs=1e-4)
    assert kolmogorov_q(1.1799) == pytest.approx(kolmogorov_q(1.1801), abs=1e-3)  # series agree
    assert chi2_sf(30.1435, 19) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(3.8415, 1) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(5.9915, 2) == pytest.approx(0.05, abs=1e-4)


# --- many draws from the shared sampler ----------------------------------------------------------
CONFIGS = [
    (1.0, -1, 1.0),
    (0.7, 40, 1.0),
    (1.3, -1, 0.9),
    (0.9, 20, 0.8),
    (1.5, 5, 0.95),
    (0.8, -1, 0.6),
]


def _battery() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [
        torch.randn(258, generator=g) * (1.0 + 2.0 * torch.rand(1, generator=g).item())
        for _ in range(60)
    ]


def _draws() -> list[DrawSample]:
    """60 logits vectors x 100 seeds, six parameter settings; drawn through the module attribute so
    a monkeypatched kvpage.sampling is what runs."""
    draws = []
    for i, logits in enumerate(_battery()):
        T, top_k, top_p = CONFIGS[i % len(CONFIGS)]
        for s in range(100):
            params = SamplingParams(temperature=T, top_k=top_k, top_p=top_p, seed=1000 * i + s)
            token = shared.sample_token(logits, params, shared.make_generator(params, 0))
            draws.append(DrawSample(logits, params, token))
    return draws


def _violations(draws: list[DrawSample]) -> int:
    return sum(check_draw(d.logits, d.params, d.token) is not None for d in draws)


def test_correct_shared_sampler_passes():
    draws = _draws()
    assert _violations(draws) == 0
    result = uniformity_test(draws)
    assert result.n == 6000 and result.passed
    assert result.ks_p_value > WIDE_MARGIN and result.chi2_p_value > WIDE_MARGIN, result


ORIGINAL_FILTERED = shared.filtered_probs  # kept before any test patches it


def _with_probs(probs_fn):
    """A sample_token that draws exactly like the shared one, from `probs_fn`'s probabilities."""
    return lambda logits, params, gen: (
        int(torch.argmax(logits)) if params.greedy else race_draw(probs_fn(logits, params), gen)
    )


def _tempered_by_multiplication(logits, params):
    return ORIGINAL_FILTERED(logits.float() * params.temperature, params.top_k, params.top_p)


def _race_by_multiplication(logits, params, gen):
    probs = shared.filtered_probs(logits.float() / params.temperature, params.top_k, params.top_p)
    race = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs * race))  # should be probs / race


def _top_k(logits, top_k):
    if 0 < top_k < logits.shape[-1]:
        return logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    return logits


def _top_p_drops_crossing_token(logits, top_k, top_p):
    """The token whose own mass crosses top_p is dropped (inclusive cumsum); the top one stays."""
    logits = _top_k(logits, top_k)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        drop = torch.cumsum(torch.softmax(sorted_logits, -1), -1) > top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.softmax(logits, -1)


def _top_p_over_unfiltered(logits, top_k, top_p):
    """Top-p mass measured on the distribution before top-k instead of after it."""
    kept = _top_k(logits, top_k)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
        drop = (torch.cumsum(sorted_probs, -1) - sorted_probs) >= top_p
        kept = kept.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.softmax(kept, -1)


def _top_p_mask_not_unsorted(logits, top_k, top_p):
    """The top-p mask, computed in sorted order, is applied by position without scattering back."""
    logits = _top_k(logits, top_k)
    if top_p < 1.0:
        sorted_probs = torch.softmax(torch.sort(logits, descending=True).values, -1)
        drop = (torch.cumsum(sorted_probs, -1) - sorted_probs) >= top_p
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, -1)


def _top_k_keeps_k_plus_1(logits, top_k, top_p):
    return ORIGINAL_FILTERED(logits, top_k + 1 if top_k > 0 else top_k, top_p)


# name -> (attribute of kvpage.sampling to patch, replacement, what catches it)
PLANTED = {
    "top_p_before_temperature": (
        "sample_token",
        _with_probs(probs_top_p_before_temperature),
        "draw",
    ),
    "top_k_keeps_k_plus_1": ("filtered_probs", _top_k_keeps_k_plus_1, "draw"),
    "temperature_multiplies": ("sample_token", _with_probs(_tempered_by_multiplication), "both"),
    "race_by_multiplication": ("sample_token", _race_by_multiplication, "stat"),
    "top_p_drops_crossing_token": ("filtered_probs", _top_p_drops_crossing_token, "stat"),
    "top_p_over_unfiltered": ("filtered_probs", _top_p_over_unfiltered, "both"),
    "top_p_mask_not_unsorted": ("filtered_probs", _top_p_mask_not_unsorted, "both"),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_shared_sampler_bug_is_caught(bug, monkeypatch):
    attr, broken, caught_by = PLANTED[bug]
    monkeypatch.setattr(shared, attr, broken)
    draws = _draws()
    violations, result = _violations(draws), uniformity_test(draws)
    if caught_by in ("draw", "both"):
        assert violations > 0, f"{bug}: no impossible draw among {len(draws)}"
    if caught_by in ("stat", "both"):
        assert result.p_value < SAMPLING_P_THRESHOLD, f"{bug}: {result}"
    if caught_by == "stat":  # the draws all look possible: only the statistics see the bug
        assert violations == 0


def test_planted_k_plus_1_agrees_with_the_correct_filter_elsewhere():
    """The planted top-k bug is visible only where top-k is on: the probabilities it races equal
    the oracle's for top_k=-1 (so the oracle catches the bug, not some unrelated difference)."""
    params = SamplingParams(temperature=0.7, top_k=-1, top_p=0.9)
    logits = _battery()[0]
    probs = probs_top_k_off_by_one(logits, params).double()
    assert torch.allclose(probs, oracle_probs(logits, 0.7, -1, 0.9), atol=1e-6)


# --- logprobs ------------------------------------------------------------------------------------
def test_check_logprobs():
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        logits = torch.randn(258, generator=g) * 3
        assert check_logprobs(logits, shared.top_logprobs(logits, 5), 5) is None
        assert check_logprobs(logits, {}, 0) is None
        tempered = shared.top_logprobs(logits / 0.7, 5)  # same ids, tempered values
        assert "tempered" in check_logprobs(logits, tempered, 5)
        exact = torch.log_softmax(logits.double(), -1)
        ids = torch.sort(exact, descending=True).indices.tolist()
        wrong_set = {i: float(exact[i]) for i in ids[:4] + ids[5:6]}  # the 6th instead of the 5th
        assert "not among the 5 most likely" in check_logprobs(logits, wrong_set, 5)
        assert "4 logprobs reported" in check_logprobs(logits, shared.top_logprobs(logits, 4), 5)


# --- attribution fields --------------------------------------------------------------------------
def test_describe_sampler_state():
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11)
    gen, twin = shared.make_generator(params, 0), shared.make_generator(params, 0)
    logits = _battery()[3]
    before = describe_sampler_state(params, gen, 0, logits)
    shared.sample_token(logits, params, gen)
    after = describe_sampler_state(params, gen, 1)
    assert before["seed"] == before["generator_seed"] == 11 and after["generator_offset"] == 1
    assert len(before["generator_state"]) == 16
    assert after["generator_state"] != before["generator_state"]
    shared.sample_token(logits, params, twin)
    assert describe_sampler_state(params, twin, 1)["generator_state"] == after["generator_state"]
    probs = oracle_probs(logits, 0.8, 40, 0.9)
    assert before["support_size"] == int((probs > 0).sum()) <= 40
    assert before["support"][0] == int(torch.argmax(logits))
    ids = before["support"]
    assert len(ids) == min(before["support_size"], SUPPORT_CAP)
    assert all(probs[a] >= probs[b] > 0 for a, b in zip(ids, ids[1:], strict=False))
    wide = filtered_support(logits, SamplingParams(temperature=2.0))
    assert wide.size == 258 and len(wide.ids) == SUPPORT_CAP
    greedy = describe_sampler_state(SamplingParams(), None, 0, logits)
    assert greedy["generator_state"] is None and greedy["support"] == [int(torch.argmax(logits))]


# --- end to end through the real engine ----------------------------------------------------------
E2E_PARAMS = dict(temperature=0.9, top_p=0.9, top_k=40, max_tokens=24, ignore_eos=True, logprobs=3)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def _traced_run(prompts, params):
    llm = LLM(MODEL, block_size=16)
    llm.engine.add_observer(EngineTracer(llm.engine))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.engine.tracer.records


def _engine_draws(outs, records, params) -> list[DrawSample]:
    draws = []
    for out, p in zip(outs, params, strict=True):
        steps = records[out.request_id]
        assert [r.chosen_token for r in steps] == out.outputs[0].token_ids
        draws += [DrawSample(r.logits, p, r.chosen_token) for r in steps]
    return draws


def test_engine_end_to_end_passes_then_fails_with_a_planted_shared_bug(monkeypatch):
    prompts = _prompts(64, seed=5)
    params = [SamplingParams(seed=500 + i, **E2E_PARAMS) for i in range(64)]
    outs, records = _traced_run(prompts, params)
    draws = _engine_draws(outs, records, params)
    assert len(draws) == 64 * 24 and _violations(draws) == 0
    result = uniformity_test(draws)
    assert result.p_value > WIDE_MARGIN, result
    for out in outs:  # the engine's logprobs, from the raw logits of each step
        for step, reported in zip(records[out.request_id], out.outputs[0].logprobs, strict=True):
            assert check_logprobs(step.logits, reported, 3) is None

    monkeypatch.setattr(shared, "filtered_probs", _top_p_mask_not_unsorted)
    outs, records = _traced_run(prompts, params)
    draws = _engine_draws(outs, records, params)
    assert _violations(draws) > 0
    assert uniformity_test(draws).p_value < SAMPLING_P_THRESHOLD
    # The differential diff is blind to it: the reference draws through the same broken code.
    model = load_model(MODEL)[0]
    for i in (0, 1, 2):
        assert generate(model, prompts[i], params[i]).token_ids == outs[i].outputs[0].token_ids


# --- engine-only mutants -------------------------------------------------------------------------
MUTANT_PARAMS = dict(temperature=1.3, top_k=5, top_p=0.9, max_tokens=16, ignore_eos=True)
PREEMPTED = ("1", "4")


class Workload(NamedTuple):
    model: object
    tokenizer: object
    prompts: list[list[int]]
    params: list[SamplingParams]
    expected: list[list[int]]  # the reference's tokens, each request alone


@pytest.fixture(scope="module")
def mutant_workload() -> Workload:
    """Eight seeded requests in one batch (shared generator), two of them preempted by recompute
    (reseeding), T far from 1 with top_p < 1 (top-p before temperature), a small top_k whose
    sixth token has real mass (off by one)."""
    model, tok = load_model(MODEL)
    prompts = _prompts(8, seed=9)
    params = [SamplingParams(seed=900 + i, **MUTANT_PARAMS) for i in range(8)]
    expected = [generate(model, p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    return Workload(model, tok, prompts, params, expected)


def _run_engine(w: Workload, mutant=None) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(model=MODEL, block_size=16, num_blocks=64), w.model, w.tokenizer
    )
    if mutant is not None:
        mutant.apply(engine)
    for i, (p, sp) in enumerate(zip(w.prompts, w.params, strict=True)):
        engine.add_request(str(i), p, sp)
    for rid in PREEMPTED:
        engine.force_preempt(rid, after_tokens=4, resume_after_steps=1, mode="recompute")
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    assert engine.scheduler.preemptions["recompute"] == len(PREEMPTED)
    return [tokens[str(i)] for i in range(len(w.prompts))]


def test_unmutated_engine_matches_reference_on_the_mutant_workload(mutant_workload):
    assert _run_engine(mutant_workload) == mutant_workload.expected


@pytest.mark.parametrize("mutant", SAMPLING_MUTANTS, ids=lambda m: m.name)
def test_sampling_mutant_diverges_from_reference(mutant, mutant_workload):
    assert mutant.expected_class == "sampling"
    got, expected = _run_engine(mutant_workload, mutant), mutant_workload.expected
    differing = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert differing, f"{mutant.name}: every request matched the reference"
    if mutant.name == "generator_reseeded_on_recompute":  # only the preempted requests drift
        assert {str(i) for i in differing} <= set(PREEMPTED)
