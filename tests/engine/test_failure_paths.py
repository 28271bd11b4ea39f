"""Failure paths: abort while waiting / running / swapped, timeout, swap-write failure, cancelled
recompute, and preemption switched off while every block is held. After each, the pool, the
ref_counts and the index return to baseline and the other requests still produce the reference's
tokens."""

from __future__ import annotations

import random
import time

import pytest

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.engine.sequence import SeqStatus
from kvpage.model import load_model
from kvpage.verify.driver import StepDriver

from .test_differential import assert_idle_baseline
from .test_events import Recorder
from .workload import prefix_prompts

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("builtin:tiny-llama")


def _engine(tiny, **kw) -> LLMEngine:
    args = dict(block_size=16, num_blocks=64, debug_checks=True, swap_space_blocks=64)
    args.update(kw)
    return LLMEngine(EngineConfig(**args), *tiny)


def _drive(engine, until=None, max_steps=2000, done=None) -> dict[str, object]:
    """Step until idle (or until `until()` holds); collects the finished outputs by id."""
    done = {} if done is None else done
    for _ in range(max_steps):
        if until is not None and until():
            return done
        if not engine.has_unfinished_requests():
            return done
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    raise AssertionError("engine did not finish")


def _add(engine, prompts, prefix="r"):
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, PARAMS)


def _check_survivors(done, prompts, references, skip=()):
    ref = references("builtin:tiny-llama")
    for i, p in enumerate(prompts):
        if f"r{i}" in skip:
            continue
        assert done[f"r{i}"].outputs[0].token_ids == ref.tokens(p, PARAMS), f"r{i} diverged"


def _status(engine, request_id):
    return engine.seqs[request_id].status


def test_abort_waiting_running_swapped(tiny, references):
    prompts = prefix_prompts(16, 258, n=6, seed=11)
    engine = _engine(tiny, max_num_seqs=3, preemption_mode="swap")
    _add(engine, prompts)
    driver = StepDriver(engine)
    driver.force_preempt("r1", after_tokens=3, resume_after_steps=50, mode="swap")
    _drive(driver, until=lambda: "r1" in engine.seqs and _status(engine, "r1") is SeqStatus.SWAPPED)
    assert _status(engine, "r5") is SeqStatus.WAITING
    assert _status(engine, "r0") is SeqStatus.RUNNING
    assert engine.stats()["swap_space_used"] > 0
    for rid in ("r5", "r0", "r1"):
        assert engine.abort_request(rid)
    assert engine.stats()["swap_space_used"] == 0
    done = _drive(driver)
    for rid in ("r5", "r0", "r1"):
        assert done[rid].outputs[0].finish_reason == "abort"
    assert engine.stats()["aborts"] == 3
    _check_survivors(done, prompts, references, skip={"r0", "r1", "r5"})
    assert_idle_baseline(engine)
    assert not engine.abort_request("r0")  # already gone: a no-op, not an error


def test_timeout(tiny, references):
    prompts = prefix_prompts(16, 258, n=4, seed=12)
    engine = _engine(tiny)
    _add(engine, prompts[:3])
    engine.add_request(
        "slow", prompts[3], SamplingParams(max_tokens=200, ignore_eos=True), timeout_s=0.05
    )
    _drive(engine, until=lambda: engine.step_count >= 2)
    time.sleep(0.06)
    done = _drive(engine)
    assert done["slow"].outputs[0].finish_reason == "timeout"
    assert 0 < len(done["slow"].outputs[0].token_ids) < 200
    assert engine.stats()["timeouts"] == 1
    _check_survivors(done, prompts[:3], references)
    assert_idle_baseline(engine)


def test_swap_write_failure_falls_back_to_recompute(tiny, references):
    prompts = prefix_prompts(16, 258, n=5, seed=13)
    engine = _engine(tiny, preemption_mode="swap")
    _add(engine, prompts)
    driver = StepDriver(engine)
    driver.fail_swap_writes(1)
    driver.force_preempt("r2", after_tokens=5, resume_after_steps=2, mode="swap")
    done = _drive(driver)
    s = engine.stats()
    assert s["swap_failures"] == 1 and s["swap_outs"] == 0
    assert s["preemptions_recompute"] == 1 and done["r2"].metrics.num_preemptions == 1
    _check_survivors(done, prompts, references)
    assert_idle_baseline(engine)


def test_cancel_recompute(tiny, references):
    """Abort a request after its recompute preemption: once queued for re-prefill, and once
    half-way through the re-prefill (chunked)."""
    prompts = prefix_prompts(16, 258, n=4, seed=14)
    # No prefix caching: the re-prefill must recompute everything, in 8-token chunks.
    engine = _engine(
        tiny, max_num_batched_tokens=8, preemption_mode="recompute", enable_prefix_caching=False
    )
    _add(engine, prompts)
    driver = StepDriver(engine)
    driver.force_preempt("r0", after_tokens=4, resume_after_steps=3)
    driver.force_preempt("r1", after_tokens=4, resume_after_steps=0)

    def r1_reprefilling():
        seq = engine.seqs.get("r1")
        return (
            seq is not None
            and seq.num_preemptions == 1
            and seq.status is SeqStatus.RUNNING
            and 0 < seq.num_computed < seq.num_tokens - 1
        )

    done = {}
    _drive(
        driver,
        until=lambda: (
            engine.seqs["r0"].status is SeqStatus.WAITING and engine.seqs["r0"].num_preemptions == 1
        ),
        done=done,
    )
    assert engine.abort_request("r0")
    _drive(driver, until=r1_reprefilling, done=done)
    assert engine.abort_request("r1")
    _drive(driver, done=done)
    assert done["r0"].outputs[0].finish_reason == done["r1"].outputs[0].finish_reason == "abort"
    _check_survivors(done, prompts, references, skip={"r0", "r1"})
    assert_idle_baseline(engine)


def test_preemption_kill_switch_admits_only_what_fits(tiny, references):
    """With preemption switched off, admission reserves each request's worst case, so a tight pool
    runs requests a few at a time instead of deadlocking."""
    prompts = prefix_prompts(16, 258, n=8, seed=15)
    engine = _engine(tiny, num_blocks=12)
    engine.set_preemption(False)
    _add(engine, prompts)
    done = _drive(engine)
    assert engine.stats()["preemptions"] == 0
    _check_survivors(done, prompts, references)
    assert_idle_baseline(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_mid_prefill_with_a_remainder_over_the_budget_comes_back(tiny, references, mode):
    """Regression: a request swapped out after its first prefill chunk, with more
    prompt left than a whole step's budget, was never restored and blocked every admission."""
    model, tokenizer = tiny
    prompts = prefix_prompts(16, 258, n=3, seed=16)
    big = [t for p in prompts for t in p][:100]
    engine = _engine(
        tiny, block_size=8, num_blocks=40, max_num_batched_tokens=16, preemption_mode=mode
    )
    engine.add_request("big", big, PARAMS)
    _drive(engine, until=lambda: engine.seqs["big"].num_computed > 0)
    assert len(big) - engine.seqs["big"].num_computed > 16
    driver = StepDriver(engine)
    driver.force_preempt("big", after_tokens=0, resume_after_steps=1, mode=mode)
    driver.step()
    expected_status = SeqStatus.SWAPPED if mode == "swap" else SeqStatus.WAITING
    assert _status(engine, "big") is expected_status
    _add(engine, prompts[:2])  # arrive after it: admitted only once it is back
    done = _drive(driver, max_steps=200)
    ref = references("builtin:tiny-llama")
    assert done["big"].outputs[0].token_ids == ref.tokens(big, PARAMS)
    _check_survivors(done, prompts[:2], references)
    assert engine.stats()["swap_ins"] == (1 if mode == "swap" else 0)
    assert_idle_baseline(engine)


def _distinct(n: int, length: int, seed: int) -> list[list[int]]:
    """Prompts sharing no prefix: no hit or cached block changes who holds what."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 258) for _ in range(length)] for _ in range(n)]


def test_preemption_switched_off_with_every_block_held(tiny, references):
    """Livelock: preemption goes off while two requests run that each need five
    blocks of an eight-block pool. When both need their fifth, no step can ever free one: the
    newest fails with finish reason "error" (and says why), its blocks come back, the other and
    a request queued behind them finish with the reference's tokens."""
    prompts = _distinct(3, 30, seed=17)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = _engine(tiny, num_blocks=8)
    recorder = Recorder()
    engine.add_observer(recorder)
    engine.add_request("r0", prompts[0], params)
    engine.add_request("r1", prompts[1], params)
    engine.step()  # both admitted, while preemption is still on
    engine.set_preemption(False)
    engine.add_request("r2", prompts[2], params)
    done = _drive(engine, max_steps=500)
    failed = done["r1"]
    assert failed.outputs[0].finish_reason == "error"
    assert "preemption is off" in failed.error and "'r1'" in failed.error
    ref = references("builtin:tiny-llama")
    # Four blocks hold positions 0..63: it drew its 35th token, whose KV (position 64) had no room.
    assert failed.outputs[0].token_ids == ref.tokens(prompts[1], params)[:35]
    for rid in ("r0", "r2"):
        assert done[rid].error is None
        assert done[rid].outputs[0].token_ids == ref.tokens(prompts[int(rid[1])], params), rid
    (error,) = [e for e in recorder.events if e.kind == "finish" and e.reason == "error"]
    assert error.request_id == "r1" and error.error == failed.error
    assert engine.stats()["preemptions"] == 0
    assert_idle_baseline(engine)


def test_worst_case_of_a_parallel_request_counts_every_sample(tiny, references):
    """With preemption off, admission reserves a request's worst case. A request with n = 2 is
    one sequence until its first token, but grows into two: it reserves both (2 x 4 of an 8-block
    pool), so the request behind it waits. Counted once, the other would be admitted too, and at
    position 48 all three sequences would need a block with none left (and one would fail)."""
    prompts = _distinct(2, 20, seed=18)
    pair = SamplingParams(n=2, max_tokens=40, ignore_eos=True)
    single = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = _engine(tiny, num_blocks=8)
    engine.set_preemption(False)
    engine.add_request("pair", prompts[0], pair)
    engine.add_request("single", prompts[1], single)
    done = _drive(engine, max_steps=500)
    ref = references("builtin:tiny-llama")
    for c in done["pair"].outputs:
        assert c.finish_reason == "length"
        assert c.token_ids == ref.tokens(prompts[0], pair.for_sample(c.index)), c.index
    assert done["single"].outputs[0].token_ids == ref.tokens(prompts[1], single)
    assert engine.stats()["preemptions"] == 0
    assert_idle_baseline(engine)


def test_parallel_request_larger_than_the_pool_without_preemption(tiny, references):
    """Its samples together could need 12 blocks of a 7-block pool: it is admitted once it has
    the pool to itself (not left waiting forever). At position 48 all three samples need a
    block with none left: the newest sample fails and the others finish with the reference's
    tokens."""
    (prompt,) = _distinct(1, 20, seed=19)
    params = SamplingParams(n=3, max_tokens=40, ignore_eos=True)
    engine = _engine(tiny, num_blocks=7)
    engine.set_preemption(False)
    engine.add_request("big", prompt, params)
    out = _drive(engine, max_steps=500)["big"]
    reasons = [c.finish_reason for c in out.outputs]
    assert reasons == ["length", "length", "error"]
    assert "'big#2'" in out.error
    ref = references("builtin:tiny-llama")
    for c in out.outputs[:2]:
        assert c.token_ids == ref.tokens(prompt, params.for_sample(c.index)), c.index
    assert_idle_baseline(engine)
