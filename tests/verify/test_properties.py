"""The per-step properties (kvpage.verify.properties): each holds on the real engine in the case
that exercises it, and each fails, with its own attribution class and every field that class
needs, on the mutant that plants a bug of its kind. The checks' arithmetic is tested against
numbers worked out here by hand, never against the engine's own."""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import torch

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.engine.events import Finished
from kvpage.engine.plan import ScheduledSeq, StepPlan
from kvpage.model import load_model
from kvpage.reference.records import EMPTY_VIEW, StepRecord
from kvpage.sampling_params import SamplingParams
from kvpage.verify.case import Case, RequestSpec
from kvpage.verify.cases import build_suites
from kvpage.verify.diff import REQUIRED_FIELDS, WHERE_TO_LOOK
from kvpage.verify.mutants import MUTANTS
from kvpage.verify.properties import (
    StepProperties,
    check_independence,
    pair_p_value,
    pin_unseeded,
)
from kvpage.verify.suites import Runtime, run_case
from kvpage.verify.trace import EngineTracer


@dataclass
class _Completion:
    index: int
    tag: int


@dataclass
class _Output:
    request_id: str
    outputs: list = field(default_factory=list)


CLASSES = ("step_budget", "sample_independence", "finish_precedence", "reservation", "prefix_hold")


@pytest.fixture(scope="module")
def runtime():
    model, tokenizer = load_model("builtin:tiny-llama")
    return Runtime(model, tokenizer, "builtin:tiny-llama")


def _case(name: str, runtime) -> Case:
    suite = name.split("/")[0]
    cases = build_suites(runtime.model.config.vocab_size, (suite,))
    return next(c for c in cases if c.full_name == name)


def _mutant_runtime(runtime, name: str) -> Runtime:
    mutant = next(m for m in MUTANTS if m.name == name)

    def factory(cfg: EngineConfig) -> LLMEngine:
        engine = LLMEngine(replace(cfg, **mutant.config), runtime.model, runtime.tokenizer)
        mutant.apply(engine)
        return engine

    return Runtime(
        runtime.model, runtime.tokenizer, runtime.model_name, False, engine_factory=factory
    )


def _property_failures(result):
    return [f for f in result.failures if f.kind == "property"]


# --- the engine and its mutants -----------------------------------------------------------------
CAUGHT = (  # mutant, the case that exercises it, the class its first divergence must get
    ("restore_ignores_budget", "resources/preempt_mid_prefill_swap", "step_budget"),
    ("seq_cap_off_by_one", "failure/abort_waiting_running_swapped", "step_budget"),
    ("unseeded_engine_seed", "sampling/unseeded_independent", "sample_independence"),
    ("fork_copies_generator", "sampling/unseeded_independent", "sample_independence"),
    ("length_before_stop", "stop/stop_at_max_tokens", "finish_precedence"),
    ("reservation_ignores_running", "resources/reservation_preemption_off", "reservation"),
    ("reservation_counts_held_twice", "resources/reservation_preemption_off", "reservation"),
    ("hold_on_published_blocks", "policy/same_step_sharing", "prefix_hold"),
)


@pytest.mark.parametrize("case_name", sorted({c for _, c, _ in CAUGHT}))
def test_the_honest_engine_keeps_every_property(runtime, case_name):
    result = run_case(_case(case_name, runtime), runtime)
    assert result.passed, [f.message for f in result.failures]


@pytest.mark.parametrize(("mutant", "case_name", "cls"), CAUGHT)
def test_each_property_fails_on_its_mutant_first(runtime, mutant, case_name, cls):
    result = run_case(_case(case_name, runtime), _mutant_runtime(runtime, mutant))
    first = result.first_divergence
    assert first is not None, [f.message for f in result.failures]
    assert first.attribution.cls == cls, first.detail
    assert first.attribution.complete, first.attribution.missing
    assert result.failures[0].kind == "property"


def test_the_property_mutants_are_in_the_gate_with_their_classes():
    expected = {m: cls for m, _, cls in CAUGHT}
    planted = {m.name: m.expected_class for m in MUTANTS if m.name in expected}
    assert planted == expected
    for cls in CLASSES:
        assert REQUIRED_FIELDS[cls] and WHERE_TO_LOOK[cls]


# --- the cases reach what they are built for --------------------------------------------------
class _Steps(StepProperties):
    """Also keeps what each plan scheduled, to show the cases reach their limits."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.tokens: list[int] = []
        self.waiting: list[int] = []
        self.first_step: dict[str, int] = {}

    def on_plan(self, plan) -> None:
        super().on_plan(plan)
        self.tokens.append(sum(i.num_new_tokens for i in plan.scheduled))
        self.waiting.append(len(self.engine.scheduler.waiting))
        for item in plan.scheduled:
            self.first_step.setdefault(item.seq.sample_id, plan.step)


def _drive(runtime, engine_args: dict, specs: list[RequestSpec], before=None) -> _Steps:
    engine = runtime.make_engine(engine_args)
    watch = _Steps(engine)
    engine.add_observer(watch)
    if before is not None:
        before(engine)
    for spec in specs:
        engine.add_request(spec.request_id, spec.prompt, spec.params, cache_salt=spec.cache_salt)
    while engine.has_unfinished_requests():
        engine.step()
    return watch


def test_a_tight_token_budget_is_reached_and_kept(runtime):
    specs = [RequestSpec(f"r{i}", list(range(3, 33 + i)), _greedy(4)) for i in range(3)]
    watch = _drive(runtime, dict(block_size=8, max_num_batched_tokens=16), specs)
    assert max(watch.tokens) == 16 and watch.failures == []


def test_preemption_off_case_keeps_requests_waiting_that_do_not_fit(runtime):
    """The pool holds five worst cases of eight: some request must wait (a refusal the rule
    allows), and every one still finishes by length."""
    case = _case("resources/reservation_preemption_off", runtime)
    watch = _drive(runtime, case.engine, case.requests, lambda e: e.set_preemption(False))
    assert watch.failures == []
    assert max(watch.waiting) > 0
    worst = math.ceil((12 + 18) / 8)
    assert case.engine["num_blocks"] < worst * len(case.requests)


def test_same_step_sharers_are_held_once_and_admitted_next_step(runtime):
    """The writer and the request that shares nothing start at step 1; each sharer of the
    writer's blocks is held exactly one step."""
    case = _case("policy/same_step_sharing", runtime)
    watch = _drive(runtime, case.engine, case.requests)
    assert watch.failures == []
    first = watch.first_step
    assert first["w"] == first["solo"] == first["b.w"] == 1
    assert [first[f"s{i}"] for i in range(4)] == [2, 2, 2, 2]


def test_stop_at_max_tokens_case_draws_stops_on_the_last_token(runtime):
    case = _case("stop/stop_at_max_tokens", runtime)
    at_max = 0
    for spec in case.requests:
        ref = runtime.reference(runtime.resolve(spec), case.engine["block_size"])
        at_max += ref.finish_reason == "stop" and len(ref.token_ids) == spec.params.max_tokens
    assert at_max >= 4


def test_unseeded_case_is_far_from_the_threshold_on_the_honest_engine(runtime):
    """Independent samples rarely agree long: the closest honest pair is nowhere near the
    failure threshold, and the case has enough pairs to see lockstep."""
    case = _case("sampling/unseeded_independent", runtime)
    engine = runtime.make_engine(case.engine)
    engine.add_observer(EngineTracer(engine))
    for spec in case.requests:
        engine.add_request(spec.request_id, spec.prompt, spec.params)
    while engine.has_unfinished_requests():
        engine.step()
    assert check_independence(case, engine.tracer.records) == []
    seeds = {rec[0].sampler["seed"] for rec in engine.tracer.records.values()}
    assert len(seeds) == 10  # every sample its own generator


# --- the checks' arithmetic -----------------------------------------------------------------
def _records(sid: str, tokens: list[int], vocab: int, seed: int | None = None):
    """One sample's records with uniform logits over `vocab`; its own seed unless given."""
    seed = zlib.crc32(sid.encode()) if seed is None else seed
    return [
        StepRecord(
            sid,
            i,
            [],
            [],
            "",
            [],
            [],
            t,
            EMPTY_VIEW,
            sampler={"seed": seed},
            logits=torch.zeros(vocab),
        )
        for i, t in enumerate(tokens)
    ]


def _unseeded_case(n_samples: int, temperature: float = 1.0) -> Case:
    params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, n=n_samples)
    return Case("t", "t", [RequestSpec("u", [5, 6, 7], params)])


def test_lockstep_p_value_is_the_product_of_the_oracle_probabilities():
    """Uniform logits over 8 tokens: B repeating A's 6 tokens has probability 8^-6 = 3.8e-6;
    one pair, so the threshold is 1e-4 and it fails, with that p-value."""
    case = _unseeded_case(2)
    tokens = [1, 2, 3, 4, 5, 6]
    records = {"u#0": _records("u#0", tokens, 8), "u#1": _records("u#1", tokens, 8)}
    (failure,) = check_independence(case, records)
    fields = failure.divergence.attribution.fields
    assert fields["agreed_steps"] == 6 and fields["pairs"] == 1
    assert fields["p_value"] == pytest.approx(8.0**-6)
    assert failure.divergence.attribution.cls == "sample_independence"
    assert failure.divergence.attribution.complete


def test_short_agreement_and_many_pairs_do_not_fail():
    """Four tokens alike (8^-4 = 2.4e-4) pass a single pair; with 4 samples (6 pairs) the
    threshold drops to 1.7e-5, so five alike (3.1e-5) still pass and six (3.8e-6) fail."""
    two = _unseeded_case(2)
    same = [1, 2, 3, 4]
    assert (
        check_independence(
            two, {"u#0": _records("u#0", same, 8), "u#1": _records("u#1", same + [0], 8)}
        )
        == []
    )
    four = _unseeded_case(4)
    base = {f"u#{i}": _records(f"u#{i}", [i, 7, 7, 7, 7, 7], 8) for i in range(4)}
    five = dict(base, **{"u#1": _records("u#1", [0, 7, 7, 7, 7, 6], 8)})
    assert check_independence(four, five) == []
    six = dict(base, **{"u#1": _records("u#1", [0, 7, 7, 7, 7, 7], 8)})
    assert len(check_independence(four, six)) == 1


def test_false_alarms_stay_below_the_nominal_rate():
    """Independent uniform draws over 4 tokens, 10 steps, 2000 pairs: the fraction whose
    p-value is at most a level never exceeds the level beyond sampling noise, so the statistic
    is a valid p-value (the union bound over pairs does the rest). Exactly: P(p <= 4^-l) is
    P(the first l draws agree) = 4^-l."""
    rng = random.Random(3)
    params = SamplingParams(temperature=1.0, max_tokens=10)
    ps = []
    for _ in range(2000):
        a = _records("a", [rng.randrange(4) for _ in range(10)], 4)
        b = _records("b", [rng.randrange(4) for _ in range(10)], 4)
        ps.append(pair_p_value(a, b, params)[0])
    for level in (0.3, 0.1, 0.02):
        rate = sum(p <= level for p in ps) / len(ps)
        assert rate <= level + 3 * math.sqrt(level / len(ps)), (level, rate)
    assert min(ps) >= 4.0**-10


def test_unseeded_samples_sharing_a_seed_fail_whatever_their_prompts():
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    case = Case("t", "t", [RequestSpec("a", [5], unseeded), RequestSpec("b", [6, 7], unseeded)])
    records = {"a": _records("a", [1, 2], 8, seed=42), "b": _records("b", [1, 3], 8, seed=42)}
    (failure,) = check_independence(case, records)
    fields = failure.divergence.attribution.fields
    assert fields["samples"] == ["a", "b"] and fields["seeds"] == [42, 42]
    assert fields["agreed_steps"] == 1 and failure.divergence.attribution.complete
    records["b"] = _records("b", [1, 3], 8, seed=43)
    assert check_independence(case, records) == []


def test_seeded_and_greedy_samples_are_not_paired():
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, n=2)
    case = Case("t", "t", [RequestSpec("s", [5], params), RequestSpec("g", [5], _greedy(8))])
    same = [1, 2, 3, 4, 5, 6, 7, 1]
    records = {sid: _records(sid, same, 8) for sid in ("s#0", "s#1", "g")}
    assert check_independence(case, records) == []


def test_pin_unseeded_replays_each_samples_own_seed():
    params = SamplingParams(temperature=1.0, max_tokens=3, n=2)
    case = Case("t", "t", [RequestSpec("u", [5], params), RequestSpec("g", [5], _greedy(3))])
    records = {"u#0": _records("u#0", [1], 8, seed=11), "u#1": _records("u#1", [1], 8, seed=29)}
    finished = {"u": _Output("u", [_Completion(0, 0), _Completion(1, 1)]), "g": _Output("g")}
    pinned, outputs = pin_unseeded(case, records, finished)
    by_id = {s.request_id: s for s in pinned.requests}
    assert by_id["u#0"].params.seed == 11 and by_id["u#1"].params.seed == 29
    assert by_id["u#1"].params.n == 1 and by_id["g"] is case.requests[1]
    assert [c.index for c in outputs["u#1"].outputs] == [0]
    assert outputs["u#1"].outputs[0].tag == 1


# --- the step rules on hand-made plans -----------------------------------------------------------
def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _fake_engine(max_tokens=10, max_seqs=3, to_fork=(), eos=(2,), sample=None):
    scheduler = SimpleNamespace(
        to_fork=set(to_fork), running=[], waiting=[], swapped=[], preemption_enabled=True
    )
    cache = SimpleNamespace(enable_prefix_caching=False)
    return SimpleNamespace(
        config=EngineConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs),
        scheduler=scheduler,
        cache=cache,
        model=SimpleNamespace(config=SimpleNamespace(eos_token_ids=eos)),
        requests=SimpleNamespace(sample=lambda sid: sample),
    )


def _seq(seq_id: int, n: int = 1, sid: str | None = None):
    return SimpleNamespace(
        seq_id=seq_id,
        sample_id=sid or f"r{seq_id}",
        sample_index=0,
        params=SamplingParams(n=n, max_tokens=4),
    )


def _plan(*items) -> StepPlan:
    return StepPlan(1, scheduled=[ScheduledSeq(seq, n, []) for seq, n in items])


def test_token_budget_counts_every_scheduled_token():
    props = StepProperties(_fake_engine())
    props.on_plan(_plan((_seq(0), 5), (_seq(1), 5)))
    assert props.failures == []
    props.on_plan(_plan((_seq(0), 6), (_seq(1), 5)))
    (failure,) = props.failures
    fields = failure.divergence.attribution.fields
    assert fields["scheduled_tokens"] == 11 and fields["per_seq"] == {"r0": 6, "r1": 5}
    assert failure.divergence.attribution.cls == "step_budget"


def test_a_parallel_request_about_to_fork_counts_as_its_samples():
    """Cap 3: one request with n = 4 before its fork is four sequences, not one."""
    props = StepProperties(_fake_engine(to_fork={7}))
    props.on_plan(_plan((_seq(7, n=4), 3)))
    (failure,) = props.failures
    assert failure.divergence.attribution.fields["scheduled_seqs"] == 4


def _finish(reason: str, tokens: list[int], max_tokens: int, ignore_eos=False, stops=()):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stops)
    seq = SimpleNamespace(output_ids=tokens, params=params)
    props = StepProperties(_fake_engine(sample=seq))
    props.on_event(Finished("r", "r", 0, None, "", reason=reason, num_output_tokens=len(tokens)))
    return props.failures


def test_a_stop_at_max_tokens_must_finish_as_stop():
    assert _finish("stop", [5, 2], 2) == []  # EOS (2) as the last allowed token
    (failure,) = _finish("length", [5, 2], 2)  # the same, reported as length
    assert failure.divergence.attribution.cls == "finish_precedence"
    assert failure.divergence.attribution.complete
    assert len(_finish("length", [5, 9], 2, stops=(9,))) == 1  # a stop_token_id likewise
    assert _finish("length", [5, 2], 2, ignore_eos=True) == []  # EOS ignored: length is right
    assert _finish("length", [5, 6], 2) == []
    assert _finish("stop", [2], 4) == []  # before max_tokens: not this rule's question


def test_sequence_cap_holds_while_a_parallel_request_is_still_prefilling(runtime):
    """Cap 4: a request with n = 4 in a chunked prefill reserves all four sequences, so a
    request arriving meanwhile waits for the cap. (The scheduler once counted the unforked
    request as one running sequence and admitted the newcomer: at the fork, five sequences ran
    in a step.)"""
    parallel = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    engine = runtime.make_engine(dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=16))
    watch = StepProperties(engine)
    engine.add_observer(watch)
    engine.add_request("A", list(range(3, 43)), parallel)
    engine.step()
    engine.add_request("B", list(range(50, 60)), _greedy(6))
    while engine.has_unfinished_requests():
        engine.step()
    assert watch.failures == []
