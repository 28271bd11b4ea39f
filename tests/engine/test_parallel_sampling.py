"""Parallel sampling: a request with n > 1 is prefilled once and forked into n samples that
share its blocks; the partial last block is copied on the first write (copy-on-write). Whatever the
schedule, sample i equals the contiguous reference run alone with `params.for_sample(i)`."""

from __future__ import annotations

import random

import pytest

from kvpage import LLM, LLMEngine, SamplingParams
from kvpage.cache.block_pool import BlockState
from kvpage.config import EngineConfig
from kvpage.engine.outputs import RequestOutput
from kvpage.engine.sequence import SeqStatus
from kvpage.model import load_model
from kvpage.verify.driver import StepDriver

from .test_differential import assert_idle_baseline

MODEL = "builtin:tiny-llama"
BLOCK = 8


def _seeded(seed: int, n: int, max_tokens: int = 20, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=40,
        seed=seed,
        n=n,
        max_tokens=max_tokens,
        ignore_eos=True,
        **kw,
    )


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL)


def _engine(tiny, **kw) -> LLMEngine:
    args = dict(model=MODEL, block_size=BLOCK, num_blocks=128, debug_checks=True)
    args.update(kw)
    return LLMEngine(EngineConfig(**args), *tiny)


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Unrelated random prompts (no shared prefix, so no prefix hits blur the CoW count)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


def _run(
    engine: LLMEngine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    on_step=None,
    driver: StepDriver | None = None,
):
    """Add every request, step until idle (through `driver` when given); returns (final outputs
    by id, every output in order)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final: dict[str, RequestOutput] = {}
    seen: list[RequestOutput] = []
    for step in range(5000):
        if not engine.has_unfinished_requests():
            return final, seen
        if on_step is not None:
            on_step(engine, step)
        for out in (driver or engine).step():
            seen.append(out)
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = out
    raise AssertionError("engine made no progress")


def _assert_samples_match(final, requests, ref) -> None:
    for rid, (prompt, params) in requests.items():
        out = final[rid]
        assert [c.index for c in out.outputs] == list(range(params.n)), rid
        for c in out.outputs:
            expected = ref.tokens(prompt, params.for_sample(c.index))
            assert c.token_ids == expected, f"{rid} sample {c.index} diverged"


# --- (1) differential --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_sample_equals_its_reference(tiny, references, n):
    ref = references(MODEL)
    prompts = _prompts([5, 13, 21, 30], ref.model.config.vocab_size, seed=n)
    assert all(len(p) % BLOCK for p in prompts)
    requests = {f"r{i}": (p, _seeded(100 * n + i, n)) for i, p in enumerate(prompts)}
    engine = _engine(tiny)
    final, seen = _run(engine, requests)
    _assert_samples_match(final, requests, ref)
    for out in final.values():
        assert all(c.finish_reason == "length" for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples share one seed"
    _assert_progress_per_sample(seen, final)
    assert_idle_baseline(engine)


def _assert_progress_per_sample(seen: list[RequestOutput], final) -> None:
    """Streaming: each progress output carries the one sample that advanced, and its new tokens
    add up to that sample's final tokens."""
    streamed: dict[tuple[str, int], list[int]] = {}
    for out in seen:
        if out.finished:
            assert out.new_token_ids == []
            continue
        assert out.new_token_ids
        (c,) = out.outputs
        assert c.token_ids[-len(out.new_token_ids) :] == out.new_token_ids
        streamed.setdefault((out.request_id, c.index), []).extend(out.new_token_ids)
    for rid, out in final.items():
        for c in out.outputs:
            assert streamed[(rid, c.index)] == c.token_ids


def test_greedy_samples_are_identical(tiny, references):
    ref = references(MODEL)
    (prompt,) = _prompts([13], ref.model.config.vocab_size, seed=7)
    params = SamplingParams(n=3, max_tokens=20, ignore_eos=True)
    final, _ = _run(_engine(tiny), {"g": (prompt, params)})
    expected = ref.tokens(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [c.token_ids for c in final["g"].outputs] == [expected] * 3


def test_samples_that_stop_at_their_first_token(tiny, references):
    """A child that finishes at the fork (stop token, or max_tokens 1) is released at once."""
    ref = references(MODEL)
    (prompt,) = _prompts([11], ref.model.config.vocab_size, seed=3)
    base = _seeded(40, 4)
    first = [ref.tokens(prompt, base.for_sample(i))[0] for i in range(4)]
    assert first[1] != first[0], "pick a seed whose samples 0 and 1 start differently"
    stopping = _seeded(40, 4, stop_token_ids=(first[1],))
    requests = {"stop": (prompt, stopping), "one": (prompt, _seeded(41, 3, max_tokens=1))}
    engine = _engine(tiny, enable_prefix_caching=False)
    final, _ = _run(engine, requests)
    _assert_samples_match(final, requests, ref)
    assert final["stop"].outputs[1].finish_reason == "stop"
    assert final["stop"].outputs[1].token_ids == [first[1]]
    assert [len(c.token_ids) for c in final["one"].outputs] == [1, 1, 1]
    assert_idle_baseline(engine)


def test_llm_generate_returns_n_outputs_per_prompt(references):
    ref = references(MODEL)
    prompts = _prompts([6, 17], ref.model.config.vocab_size, seed=11)
    params = _seeded(5, 3, max_tokens=12)
    llm = LLM(MODEL, block_size=BLOCK, num_blocks=64, debug_checks=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 2
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finished and len(out.outputs) == 3
        for c in out.outputs:
            assert c.token_ids == ref.tokens(prompt, params.for_sample(c.index))
            assert c.text == llm.tokenizer.decode(c.token_ids)


# --- (2) copy-on-write is reached ---------------------------------------------------------------
def test_fork_shares_the_partial_block_and_copies_it_once_per_child(tiny, references):
    ref = references(MODEL)
    lengths, ns = [13, 16, 5, 24, 30], [3, 3, 2, 4, 4]  # 16 and 24 end on a block boundary
    prompts = _prompts(lengths, ref.model.config.vocab_size, seed=21)
    requests = {
        f"r{i}": (p, _seeded(7 + i, n)) for i, (p, n) in enumerate(zip(prompts, ns, strict=True))
    }
    engine = _engine(tiny)
    checked = set()

    def check_fresh_forks(engine, step):
        for rid, samples in engine.samples.items():
            if rid not in checked and len(samples) > 1:
                checked.add(rid)
                _assert_shared_after_fork(engine, samples)

    final, _ = _run(engine, requests, on_step=check_fresh_forks)
    assert checked == set(requests)
    _assert_samples_match(final, requests, ref)
    stats = engine.stats()
    assert stats["preemptions"] == 0
    mid_block = sum(n - 1 for length, n in zip(lengths, ns, strict=True) if length % BLOCK)
    assert mid_block == 2 + 1 + 3
    assert stats["cow_copies"] == mid_block
    assert_idle_baseline(engine)


def _assert_shared_after_fork(engine: LLMEngine, samples) -> None:
    """Right after the fork step: every sample holds the same prompt blocks, each held n times,
    and the last (partial, unpublished) one is shared read-only."""
    blocks = engine.cache.pool.blocks
    n = len(samples)
    tables = [s.table.block_ids for s in samples]
    assert all(t == tables[0] for t in tables), tables
    assert all(len(s.output_ids) == 1 for s in samples)
    for bid in tables[0]:
        assert blocks[bid].ref_count == n
        assert blocks[bid].owners == {s.seq_id for s in samples}
        assert blocks[bid].state is BlockState.SHARED_READONLY
    prompt_len = len(samples[0].prompt_ids)
    if prompt_len % BLOCK:
        last = blocks[tables[0][-1]]
        assert last.valid_len == prompt_len % BLOCK and not last.published


def test_every_sample_publishes_its_own_blocks(tiny, references):
    """Each sample's key chain is its own (copied at the fork, before sample 0's token): a later
    prompt that continues sample i hits all of sample i's full blocks and still equals the
    reference."""
    ref = references(MODEL)
    (prompt,) = _prompts([13], ref.model.config.vocab_size, seed=51)
    params = _seeded(12, 3, max_tokens=20)
    engine = _engine(tiny)
    final, _ = _run(engine, {"p": (prompt, params)})
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    continued = {f"c{c.index}": (prompt + c.token_ids, greedy) for c in final["p"].outputs}
    after, _ = _run(engine, continued)
    for rid, (cont, _) in continued.items():
        assert after[rid].metrics.num_cached_tokens == (len(cont) - 1) // BLOCK * BLOCK, rid
        assert after[rid].outputs[0].token_ids == ref.tokens(cont, greedy), rid
    assert_idle_baseline(engine)


def test_block_boundary_prompt_needs_no_copy(tiny, references):
    ref = references(MODEL)
    (prompt,) = _prompts([2 * BLOCK], ref.model.config.vocab_size, seed=4)
    requests = {"b": (prompt, _seeded(9, 4))}
    engine = _engine(tiny)
    final, _ = _run(engine, requests)
    _assert_samples_match(final, requests, ref)
    assert engine.stats()["cow_copies"] == 0


# --- (3) under preemption -----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_samples_survive_preemption(tiny, references, mode):
    ref = references(MODEL)
    prompts = _prompts([11, 19, 5, 27, 14], ref.model.config.vocab_size, seed=31)
    requests = {f"p{i}": (p, _seeded(60 + i, 3, max_tokens=24)) for i, p in enumerate(prompts)}
    engine = _engine(tiny, num_blocks=20, preemption_mode=mode, swap_space_blocks=64)
    forced = _seeded(90, 3, max_tokens=16)
    engine.add_request("forced", prompts[0], forced)
    driver = StepDriver(engine)
    driver.force_preempt("forced#1", 2, 3, "swap")  # before the fork: kept for the child
    driver.force_preempt("forced#2", 5, 2, "recompute")
    final, _ = _run(engine, requests, driver=driver)
    _assert_samples_match(final, {**requests, "forced": (prompts[0], forced)}, ref)
    stats = engine.stats()
    assert stats["preemptions"] >= 5, stats
    if mode == "swap":
        assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]
    assert final["forced"].metrics.num_preemptions >= 2
    assert_idle_baseline(engine)


# --- (4) abort ----------------------------------------------------------------------------------
def test_abort_mid_decode_frees_every_sample(tiny, references):
    ref = references(MODEL)
    prompts = _prompts([13, 9], ref.model.config.vocab_size, seed=41)
    engine = _engine(tiny)
    keep = _seeded(3, 2, max_tokens=16)
    engine.add_request("a", prompts[0], _seeded(2, 3, max_tokens=40))
    engine.add_request("keep", prompts[1], keep)
    final: dict[str, RequestOutput] = {}
    while not (len(engine.samples["a"]) == 3 and len(engine.samples["a"][2].output_ids) >= 3):
        final.update({o.request_id: o for o in engine.step() if o.finished})
    held = {b for s in engine.samples["a"] for b in s.table.block_ids}
    assert len(held) > 3  # each sample has its own blocks by now (CoW done)
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    outs = engine.step()
    (aborted,) = [o for o in outs if o.request_id == "a" and o.finished]
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 3
    assert "a" not in engine.seqs and "a" not in engine.samples
    for bid in held:
        assert not engine.cache.pool.blocks[bid].owners
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    for c in final["keep"].outputs:
        assert c.token_ids == ref.tokens(prompts[1], keep.for_sample(c.index))
    assert engine.counters["aborts"] == 1
    assert_idle_baseline(engine)


def test_abort_before_fork_and_of_one_sample(tiny, references):
    """Aborted before its first token: n empty outputs. `rid#i` aborts sample i alone; the
    others still equal their references."""
    ref = references(MODEL)
    prompts = _prompts([10, 12], ref.model.config.vocab_size, seed=43)
    engine = _engine(tiny)
    engine.add_request("early", prompts[0], _seeded(1, 3))
    assert engine.abort_request("early")
    (early,) = [o for o in engine.step() if o.finished]
    assert early.finished and [c.token_ids for c in early.outputs] == [[], [], []]
    assert [c.finish_reason for c in early.outputs] == ["abort"] * 3

    params = _seeded(8, 3, max_tokens=16)
    engine.add_request("one", prompts[1], params)
    while len(engine.samples["one"]) < 3:
        engine.step()
    assert engine.abort_request("one#1")
    assert engine.samples["one"][1].status is SeqStatus.FINISHED
    assert engine.seqs["one"].status is SeqStatus.RUNNING
    final, _ = _run(engine, {})
    out = final["one"]
    assert [c.finish_reason for c in out.outputs] == ["length", "abort", "length"]
    for i in (0, 2):
        assert out.outputs[i].token_ids == ref.tokens(prompts[1], params.for_sample(i))
    assert out.outputs[1].token_ids == ref.tokens(prompts[1], params.for_sample(1))[:1]
    assert_idle_baseline(engine)


def test_timeout_ends_every_sample(tiny):
    """The request's deadline covers all its samples (set on sample 0, kept by the children)."""
    (prompt,) = _prompts([12], 256, seed=47)
    engine = _engine(tiny)
    engine.add_request("t", prompt, _seeded(4, 3, max_tokens=40), timeout_s=3600)
    while len(engine.samples["t"]) < 3:
        engine.step()
    engine.seqs["t"].deadline = 0.0  # already past: expires at the next step
    (out,) = [o for o in engine.step() if o.finished]
    assert [c.finish_reason for c in out.outputs] == ["timeout"] * 3
    assert [len(c.token_ids) for c in out.outputs] == [1, 1, 1]
    assert engine.counters["timeouts"] == 1
    assert_idle_baseline(engine)
