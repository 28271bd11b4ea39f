"""KV provenance on the real engine: every (block, generation) a step reads holds KV written for the
reader's own prefix. The engine passes under prefix hits, chunked prefill, preemption by recompute
and swap and parallel-sample forks; planted generation bugs are caught even on workloads where
every generated token still equals the reference."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.errors import InvariantViolation
from kvpage.model import load_model
from kvpage.reference.generator import generate
from kvpage.verify.driver import StepDriver
from kvpage.verify.mutants.cache import (
    namespace_missing_field,
    no_refcount,
    restore_visible_before_copy,
    share_partial_no_cow,
)
from kvpage.verify.mutants.generations import (
    GENERATION_MUTANTS,
    free_without_generation_bump,
    reclaim_freed_tail,
)
from kvpage.verify.trace import EngineTracer

MODEL = "builtin:tiny-llama"
B = 8
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)

# name -> engine config overrides and forced preemptions (request id, after tokens, hold, mode)
WORKLOADS = {
    # 24 blocks for 8 requests: blocks are freed, evicted and reused by other requests.
    "reuse": dict(
        num_blocks=24,
        preemption_mode="swap",
        forced=[("1", 3, 2, "recompute"), ("2", 5, 2, "swap"), ("5", 4, 1, "swap")],
    ),
    # Room to spare: a request's freed tail is still free when it comes back.
    "roomy_recompute": dict(
        num_blocks=48, forced=[("1", 3, 2, "recompute"), ("6", 2, 3, "recompute")]
    ),
    "chunked": dict(num_blocks=24, max_num_batched_tokens=16, forced=[("3", 6, 1, "swap")]),
}


@dataclass
class Run:
    engine: LLMEngine
    tracer: EngineTracer
    prompts: dict[str, list[int]]
    tokens: dict[str, list[list[int]]]  # request id -> each sample's tokens

    @property
    def violations(self):
        return self.tracer.provenance.violations


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)[0]


@pytest.fixture(scope="module")
def reference(model):
    memo: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = generate(model, prompt, PARAMS).token_ids
        return memo[tuple(prompt)]

    return tokens


def prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    """Shared prefixes of 0, 1 and 2 full blocks (+3 tokens), then a private tail."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(2 * B + 3)]
    return [
        shared[: (i % 3) * B + 3] + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 12))]
        for i in range(n)
    ]


def run(model, workload: str, mutant=None, debug_checks: bool = True) -> Run:
    """Half the requests first, the rest three steps later (they hit what the first published)."""
    spec = dict(WORKLOADS[workload])
    forced = spec.pop("forced", ())
    config = EngineConfig(
        model=MODEL, block_size=B, debug_checks=debug_checks, swap_space_blocks=64, **spec
    )
    engine = LLMEngine(config, model)
    if mutant is not None:
        mutant(engine)
    tracer = EngineTracer(engine)
    engine.add_observer(tracer)
    batch = {str(i): p for i, p in enumerate(prompts())}
    half = len(batch) // 2
    for rid in list(batch)[:half]:
        engine.add_request(rid, batch[rid], PARAMS)
    try:
        return drive(engine, tracer, batch, later=list(batch)[half:], forced=forced)
    except InvariantViolation:
        if mutant is None:
            raise
        # The broken engine tripped one of its own checks (e.g. the index's parent check after
        # no_refcount freed a shared parent block); what the tracer saw until then still counts.
        return Run(engine, tracer, batch, {})


def drive(engine, tracer, batch, later=(), forced=(), params=PARAMS) -> Run:
    tokens: dict[str, list[list[int]]] = {}
    steps = 0
    driver = StepDriver(engine)
    while engine.has_unfinished_requests() or steps <= 3:
        if steps == 3:
            for rid in later:
                engine.add_request(rid, batch[rid], params)
            for rid, after, hold, mode in forced:
                driver.force_preempt(rid, after, hold, mode)
        for out in driver.step():
            if out.finished:
                tokens[out.request_id] = [c.token_ids for c in out.outputs]
        steps += 1
        assert steps < 1000, "engine made no progress"
    return Run(engine, tracer, batch, tokens)


def assert_tokens_equal_reference(r: Run, reference) -> None:
    for rid, prompt in r.prompts.items():
        for sample in r.tokens[rid]:
            assert sample == reference(prompt), f"request {rid} diverged from the reference"


def assert_points_at_reader_record(r: Run) -> None:
    """Each violation names the record its bad step fed: the gate attributes from it."""
    records = r.tracer.records
    for v in r.violations:
        own = records[v.sample_id]
        assert v.record_step < len(own), v
        assert own[v.record_step].engine_step >= v.engine_step, v
        assert v.record_step == 0 or own[v.record_step - 1].engine_step < v.engine_step, v


# --- the engine --------------------------------------------------------------------------------
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_engine_reads_only_its_own_kv(model, reference, workload):
    r = run(model, workload)
    assert_tokens_equal_reference(r, reference)
    assert r.violations == []
    stats, engine = r.tracer.provenance.stats, r.engine.stats()
    # The check had something to check: reads of KV other requests wrote (prefix hits),
    # preemptions, and blocks freed and handed out again.
    assert stats.shared_reads > 0 and stats.reads > 0
    assert engine["prefix_hits"] > 0 and engine["preemptions"] >= len(WORKLOADS[workload]["forced"])
    if workload != "roomy_recompute":  # the tight pools: reuse and swap
        assert engine["block_allocations"] > engine["num_blocks"]
        assert stats.restored_blocks > 0 and engine["swap_ins"] > 0


def test_forked_samples_read_only_their_own_kv(model, reference):
    engine = LLMEngine(
        EngineConfig(model=MODEL, block_size=B, num_blocks=32, debug_checks=True), model
    )
    tracer = EngineTracer(engine)
    engine.add_observer(tracer)
    batch = {str(i): p for i, p in enumerate(prompts(3, seed=1))}
    params = SamplingParams(max_tokens=PARAMS.max_tokens, ignore_eos=True, n=3)
    for rid, prompt in batch.items():
        engine.add_request(rid, prompt, params)
    forced = [("0#1", 4, 2, "swap"), ("1#2", 3, 1, "recompute")]
    r = drive(engine, tracer, batch, forced=forced, params=params)
    assert all(len(samples) == 3 for samples in r.tokens.values()), "a request did not fork"
    assert_tokens_equal_reference(r, reference)  # greedy: every sample is the reference
    assert r.violations == []
    assert tracer.provenance.stats.copies > 0, "forked samples never copied a shared block"


# --- planted generation bugs: tokens agree, provenance does not -------------------------------
def test_free_without_generation_bump_is_caught(model, reference):
    r = run(model, "reuse", free_without_generation_bump)
    assert_tokens_equal_reference(r, reference)
    assert r.violations, "a block reused under its old generation went unnoticed"
    assert {v.kind for v in r.violations} == {"no_generation_bump"}
    assert_points_at_reader_record(r)
    assert all("without a generation bump" in v.message for v in r.violations)


def test_reclaimed_freed_tail_is_caught(model, reference):
    r = run(model, "roomy_recompute", reclaim_freed_tail)
    assert_tokens_equal_reference(r, reference)
    assert r.violations, "a read of a freed incarnation went unnoticed"
    assert {v.kind for v in r.violations} == {"unwritten_read"}
    assert {v.sample_id for v in r.violations} == {"1", "6"}  # the two preempted requests
    assert_points_at_reader_record(r)
    records = r.tracer.records
    for v in r.violations:
        rec = records[v.sample_id][v.record_step]
        assert rec.after_resume and rec.resume_mode == "recompute"
        assert (v.block_id, v.generation) in {(e.physical, e.generation) for e in rec.view.entries}


def test_generation_mutants_are_registered():
    # Their attribution classes are stated (independently) in tests/verify/test_gate.py.
    assert [m.name for m in GENERATION_MUTANTS] == [
        "free_without_generation_bump",
        "reclaim_freed_tail",
    ]


# --- other cache bugs leave provenance marks too ----------------------------------------------
@pytest.mark.parametrize(
    ("mutant", "kinds"),
    [
        (share_partial_no_cow, {"write_into_foreign", "stale_read"}),
        (no_refcount, {"unwritten_read"}),
        (restore_visible_before_copy, {"unwritten_read"}),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_cache_mutants_show_as_violations(model, mutant, kinds):
    r = run(model, "reuse", mutant, debug_checks=False)  # the engine's own checks would raise
    assert kinds <= {v.kind for v in r.violations}
    assert_points_at_reader_record(r)


def test_foreign_namespace_read_is_caught_with_equal_tokens(model, reference):
    """Two tenants, one prompt: a namespace without the salt shares KV across tenants. The KV is
    numerically the same, so tokens agree; provenance names the foreign namespace."""
    prompt = prompts(1, seed=2)[0] + list(range(40, 60))
    tokens = {}
    for mutant in (None, namespace_missing_field):
        engine = LLMEngine(EngineConfig(model=MODEL, block_size=B, num_blocks=24), model)
        if mutant is not None:
            mutant(engine)
        tracer = EngineTracer(engine)
        engine.add_observer(tracer)
        engine.add_request("a", prompt, PARAMS, cache_salt="tenant-a")
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("b", prompt, PARAMS, cache_salt="tenant-b")
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[mutant] = out.outputs[0].token_ids
        kinds = Counter(v.kind for v in tracer.provenance.violations)
        if mutant is None:
            assert not kinds and tracer.provenance.stats.shared_reads == 0
        else:
            assert kinds["stale_read"] > 0 and set(kinds) == {"stale_read"}
            assert all(v.sample_id == "b" for v in tracer.provenance.violations)
            assert "namespace" in tracer.provenance.violations[0].message
        assert tokens[mutant] == reference(prompt)
