"""Constrained requests preempted mid-output, by recompute and by swap, forced between steps and
forced by a tight KV pool: each sample's tokens, streamed and final, equal the same request's run
without preemption (greedy or seeded), and every output validates. Recompute rebuilds the matcher
from the tokens (a failed swap-out too); a replay that only resets it (the matcher back at the
grammar's start) changes the outputs, so the test sees the replay."""

from __future__ import annotations

import pytest

from kvpage import LLMEngine, SamplingParams, StructuredOutputsParams
from kvpage.config import EngineConfig
from kvpage.model import load_model
from kvpage.verify.driver import StepDriver

from .constraints import json_schemas, valid

MODEL = "builtin:tiny-llama"
BLOCK = 8
LONG_REGEXES = [r"[a-z]{6,12}(-[0-9]{2,4})?", r"(red|green|blue)(_[a-f]{3,5}){2}"]


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL)


def _engine(tiny, **kw) -> LLMEngine:
    args = dict(model=MODEL, block_size=BLOCK, num_blocks=128, debug_checks=True)
    return LLMEngine(EngineConfig(**(args | kw)), *tiny)


def _requests(n: int = 1, temperature: float = 0.0) -> dict[str, tuple[str, SamplingParams]]:
    """JSON schemas and regexes long enough to be preempted partway; greedy or seeded, so a
    rerun must give the same tokens."""
    constraints = [
        StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in json_schemas(4, 7)
    ] + [StructuredOutputsParams(regex=r) for r in LONG_REGEXES]
    return {
        f"r{i}": (
            f"prompt number {i} asks for",
            SamplingParams(
                n=n, temperature=temperature, max_tokens=80, seed=i, structured_outputs=c
            ),
        )
        for i, c in enumerate(constraints)
    }


def _run(engine: LLMEngine, requests, driver: StepDriver | None = None) -> dict[str, list]:
    """Step to idle; each request id -> its samples' (token ids, text, finish reason). What
    was streamed (each step's new tokens, preemptions included) adds up to the final tokens."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final, streamed = {}, {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            assert streamed == {
                (rid, i): s[0] for rid, samples in final.items() for i, s in enumerate(samples)
            }
            return final
        for out in (driver or engine).step():
            if out.new_token_ids:  # one sample's: a progress output, or n = 1's last one
                (sample,) = out.outputs
                key = (out.request_id, sample.index)
                streamed.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = [
                    (s.token_ids, s.text, s.finish_reason) for s in out.outputs
                ]
    raise AssertionError("engine made no progress")


def _assert_valid(requests, final) -> None:
    for rid, (_, params) in requests.items():
        for _, text, finish in final[rid]:
            assert finish in ("stop", "length"), (rid, finish)
            if finish == "stop":
                assert valid(params.structured_outputs, text), (rid, text)
    stopped = [f for samples in final.values() for _, _, f in samples].count("stop")
    assert stopped >= len(requests) - 1, final


def _force(driver: StepDriver, expected, mode: str) -> int:
    """Every sample preempted once mid-output (after a third to a half of the tokens it gives
    unpreempted), held 2 steps; returns how many."""
    for rid, samples in expected.items():
        for index, (tokens, _, _) in enumerate(samples):
            assert len(tokens) >= 4, (rid, tokens)  # long enough to stop partway
            driver.force_preempt(f"{rid}#{index}", len(tokens) // (2 + index % 2), 2, mode)
    return sum(len(samples) for samples in expected.values())


@pytest.mark.parametrize(("n", "temperature"), [(1, 0.0), (2, 1.0)])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_keeps_the_tokens(tiny, mode, n, temperature):
    requests = _requests(n, temperature)
    expected = _run(_engine(tiny), requests)
    _assert_valid(requests, expected)
    engine = _engine(tiny)
    replays = []
    replay = engine.grammars.replay
    engine.grammars.replay = lambda seq: (replays.append(seq.sample_id), replay(seq))
    driver = StepDriver(engine)
    forced = _force(driver, expected, mode)
    assert _run(engine, requests, driver) == expected
    stats = engine.stats()
    assert stats[f"preemptions_{mode}"] == forced, stats
    if mode == "recompute":
        assert len(replays) == stats["preemptions_recompute"]
    else:
        assert replays == []  # swap keeps the matcher as it is


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tight_pool_preemption_keeps_the_tokens(tiny, mode):
    requests = _requests()
    expected = _run(_engine(tiny), requests)
    engine = _engine(tiny, num_blocks=14, preemption_mode=mode)
    assert _run(engine, requests) == expected
    assert engine.stats()[f"preemptions_{mode}"] > 0, engine.stats()


def test_a_replay_that_only_resets_changes_the_outputs(tiny):
    """Without rebuilding the matcher from the tokens, a recomputed sample is masked from the
    grammar's start: its output changes (or breaks its grammar)."""
    requests = _requests()
    expected = _run(_engine(tiny), requests)
    engine = _engine(tiny)
    engine.grammars.replay = lambda seq: seq.grammar.matcher.reset()
    driver = StepDriver(engine)
    _force(driver, expected, "recompute")
    final = _run(engine, requests, driver)
    changed = [rid for rid in requests if final[rid] != expected[rid]]
    assert len(changed) == len(requests), changed


def test_a_failed_swap_out_recomputes_and_replays(tiny):
    """A swap-out whose copy fails falls back to recompute: that sample's matcher is replayed
    (it would otherwise be masked from the grammar's start), and the tokens stay."""
    requests = _requests()
    expected = _run(_engine(tiny), requests)
    engine = _engine(tiny)
    replays = []
    replay = engine.grammars.replay
    engine.grammars.replay = lambda seq: (replays.append(seq.sample_id), replay(seq))
    driver = StepDriver(engine)
    driver.fail_swap_writes(2)
    forced = _force(driver, expected, "swap")
    assert _run(engine, requests, driver) == expected
    stats = engine.stats()
    assert stats["preemptions_recompute"] == len(replays) == 2, (stats, replays)
    assert stats["preemptions_swap"] == forced - 2, stats
