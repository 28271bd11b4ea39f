"""The new suites exercise what they are built for on the shipped model: a case that never
reaches its path would pass on any bug of its class. Each claim is checked on the real engine."""

from __future__ import annotations

import pytest

from kvpage.model import load_model
from kvpage.verify.cases import build_suites
from kvpage.verify.suites import Runtime, run_case


@pytest.fixture(scope="module")
def runtime():
    model, tokenizer = load_model("builtin:tiny-llama")
    return Runtime(model, tokenizer, "builtin:tiny-llama")


def _case(name: str, runtime):
    suite = name.split("/")[0]
    return next(
        c for c in build_suites(runtime.model.config.vocab_size, (suite,)) if c.full_name == name
    )


def test_eos_case_ends_requests_on_eos(runtime):
    case = _case("stop/eos_sampled", runtime)
    eos = runtime.model.config.eos_token_ids
    ended = []
    for spec in case.requests:
        ref = runtime.reference(spec, case.engine["block_size"])
        if ref.finish_reason == "stop":
            ended.append(spec.request_id)
            assert ref.token_ids[-1] in eos
    assert len(ended) >= 2, ended
    assert run_case(case, runtime).passed


def test_stop_token_case_stops_at_the_planned_steps(runtime):
    case = _case("stop/stop_token_ids", runtime)
    for spec in case.requests:
        if spec.stop_at_ref_step is None:
            continue
        resolved = runtime.resolve(spec)
        ref = runtime.reference(resolved, case.engine["block_size"])
        assert ref.finish_reason == "stop"
        assert len(ref.token_ids) <= spec.stop_at_ref_step + 1


def test_narrow_fast_keys_collide_below_the_root(runtime):
    result = run_case(_case("policy/narrow_fast_keys", runtime), runtime)
    assert result.passed, [f.message for f in result.failures]
    assert result.stats["corruptions"] > 0  # fast-key hits whose digest did not confirm
    assert result.stats["prefix_hits"] > 0


def test_parallel_case_copies_on_write_and_preempts(runtime):
    forks = run_case(_case("parallel/forks_n2_to_4", runtime), runtime)
    assert forks.passed and forks.stats["cow_copies"] > 0
    for mode in ("recompute", "swap"):
        result = run_case(_case(f"parallel/forks_tiny_pool_{mode}", runtime), runtime)
        assert result.passed and result.stats["preemptions"] > 0 and result.stats["cow_copies"] > 0


def test_sampling_cases_preempt_seeded_requests(runtime):
    for mode in ("recompute", "swap"):
        result = run_case(_case(f"sampling/seeded_preempted_{mode}", runtime), runtime)
        assert result.passed
        assert result.stats[f"preemptions_{mode}"] > 0
