"""Prefix sharing inside one step: requests submitted together that share full blocks
compute them once. The later ones are held back one step, until the first one's step has written
and published the blocks, then take an ordinary hit (kvpage.engine.scheduler). Tokens equal the
contiguous reference's; `prefill_tokens` counts the prompt tokens fed to the model."""

from __future__ import annotations

import random

import pytest

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.engine.sequence import SeqStatus
from kvpage.verify.driver import StepDriver

from .test_differential import _byte_tokenizer, assert_idle_baseline

MODEL = "builtin:tiny-llama"
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _prompts(vocab: int, block_size: int, n: int, seed: int = 0) -> tuple[list[int], list]:
    """n prompts: a 3-block shared prefix plus a private tail of 1..2B-1 tokens."""
    rng = random.Random(seed)
    prefix = _tokens(rng, vocab, 3 * block_size)
    tails = [_tokens(rng, vocab, 1 + rng.randrange(2 * block_size - 1)) for _ in range(n)]
    return prefix, [prefix + tail for tail in tails]


_drivers: dict[int, StepDriver] = {}  # id(engine) -> its driver, which keeps the last plan


def _engine(ref, block_size: int, **overrides) -> LLMEngine:
    args = dict(model=MODEL, block_size=block_size, num_blocks=256, debug_checks=True)
    args.update(overrides)
    engine = LLMEngine(EngineConfig(**args), ref.model, _byte_tokenizer())
    _drivers[id(engine)] = StepDriver(engine)
    return engine


def _run(engine: LLMEngine, limit: int = 500) -> dict:
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return done
        done.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("engine made no progress")


def _scheduled_ids(engine: LLMEngine) -> set[str]:
    return {item.seq.request_id for item in _drivers[id(engine)].last_plan.scheduled}


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("budget", [2048, 40])
def test_shared_prefix_computed_once(references, block_size, budget):
    """8 prompts submitted at once: the prefix is computed by the first only, every other one
    hits all of it, each request's tokens equal the reference's. With a 40-token budget the
    writer's prefill is chunked and the others wait for budget as well."""
    ref = references(MODEL)
    prefix, prompts = _prompts(ref.model.config.vocab_size, block_size, 8, seed=block_size)
    engine = _engine(ref, block_size, max_num_batched_tokens=budget)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    done = _run(engine)

    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == ref.tokens(prompt, GREEDY), f"request {i}"
    cached = [done[str(i)].metrics.num_cached_tokens for i in range(len(prompts))]
    assert cached == [0] + [len(prefix)] * (len(prompts) - 1)
    stats = engine.stats()
    tails = sum(len(p) - len(prefix) for p in prompts)
    assert stats["prefill_tokens"] == len(prefix) + tails
    assert stats["prefix_hits"] == sum(cached)
    assert stats["prefix_queries"] == sum(len(p) for p in prompts)
    assert_idle_baseline(engine)


def test_sharers_wait_one_step_and_others_are_not_held(references):
    """The sharers are admitted one step after the writer; a request behind them that shares
    nothing, and one of another namespace (cache salt), are admitted with the writer."""
    ref = references(MODEL)
    vocab = ref.model.config.vocab_size
    prefix, prompts = _prompts(vocab, 8, 3, seed=1)
    engine = _engine(ref, 8)
    engine.add_request("w", prompts[0], GREEDY)
    engine.add_request("s1", prompts[1], GREEDY)
    engine.add_request("s2", prompts[2], GREEDY)
    engine.add_request("solo", _tokens(random.Random(2), vocab, 30), GREEDY)
    engine.add_request("tenant", prompts[1], GREEDY, cache_salt="other")
    engine.step()
    assert _scheduled_ids(engine) == {"w", "solo", "tenant"}
    assert [s.request_id for s in engine.scheduler.waiting] == ["s1", "s2"]
    assert engine.stats()["prefix_queries"] == len(prompts[0]) + 30 + len(prompts[1])
    engine.step()
    assert {"s1", "s2"} <= _scheduled_ids(engine)
    assert engine.seqs["s1"].num_cached_tokens == engine.seqs["s2"].num_cached_tokens == 24
    assert engine.seqs["tenant"].num_cached_tokens == 0
    done = _run(engine)
    for rid, prompt in (("w", prompts[0]), ("s1", prompts[1]), ("s2", prompts[2])):
        assert done[rid].outputs[0].token_ids == ref.tokens(prompt, GREEDY)
    assert engine.stats()["prefill_tokens"] == len(prefix) * 2 + 30 + sum(
        len(p) - len(prefix) for p in (*prompts, prompts[1])
    )
    assert_idle_baseline(engine)


def test_nothing_held_when_prefix_caching_is_off(references):
    """With caching off nothing will be published: nobody waits, every prompt is computed."""
    ref = references(MODEL)
    _, prompts = _prompts(ref.model.config.vocab_size, 8, 4, seed=3)
    engine = _engine(ref, 8, enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()
    assert _scheduled_ids(engine) == {"0", "1", "2", "3"}
    _run(engine)
    assert engine.stats()["prefill_tokens"] == sum(len(p) for p in prompts)


def test_aborted_writer_holds_nobody(references):
    """The writer is aborted right after the step that computed the prefix: its published blocks
    stay cached, the sharer hits them in the next step and finishes like the reference."""
    ref = references(MODEL)
    prefix, prompts = _prompts(ref.model.config.vocab_size, 8, 2, seed=4)
    engine = _engine(ref, 8)
    engine.add_request("w", prompts[0], GREEDY)
    engine.add_request("s", prompts[1], GREEDY)
    engine.step()
    assert engine.seqs["s"].status is SeqStatus.WAITING
    engine.abort_request("w")
    engine.step()
    assert engine.seqs["s"].status is SeqStatus.RUNNING
    done = _run(engine)
    assert done["s"].metrics.num_cached_tokens == len(prefix)
    assert done["s"].outputs[0].token_ids == ref.tokens(prompts[1], GREEDY)
    assert_idle_baseline(engine)


def test_writer_preempted_under_pressure(references):
    """Recompute preemption of the writer mid-decode under a tight pool: whatever is re-prefilled,
    every request still equals the reference and the counters stay consistent."""
    ref = references(MODEL)
    prefix, prompts = _prompts(ref.model.config.vocab_size, 8, 6, seed=5)
    engine = _engine(ref, 8, num_blocks=14, preemption_mode="recompute")
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    done = _run(engine, limit=2000)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == ref.tokens(prompt, GREEDY), f"request {i}"
    stats = engine.stats()
    assert stats["preemptions"] > 0
    cached = sum(o.metrics.num_cached_tokens for o in done.values())
    assert stats["prefix_hits"] == cached
    # Re-prefills after recompute count again, so at least every prompt token not hit.
    assert stats["prefill_tokens"] >= sum(len(p) for p in prompts) - cached
    assert_idle_baseline(engine)
