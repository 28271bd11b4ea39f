"""The engine's one promise: whatever the schedule — prefix sharing, chunking,
preemption by recompute or swap, forced preemption — each request's tokens equal the contiguous
reference's for that request alone. The invariant checker runs after every step (debug_checks)."""

from __future__ import annotations

import pytest

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.verify.driver import StepDriver

from .workload import prefix_prompts

MAX_TOKENS = 48
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

SCENARIOS = {
    "prefix_on": dict(enable_prefix_caching=True),
    "prefix_off": dict(enable_prefix_caching=False),
    "pressure_recompute": dict(preemption_mode="recompute", pool="tight"),
    "pressure_swap": dict(preemption_mode="swap", pool="tight", swap_space_blocks=512),
    "chunked_32": dict(max_num_batched_tokens=32),
    "forced": dict(preemption_mode="swap", swap_space_blocks=512, forced=True),
}
# (request index, after this many output tokens, resume after steps, mode)
FORCED = [
    (2, 1, 3, "recompute"),
    (9, 24, 2, "swap"),
    (16, MAX_TOKENS - 1, 1, "recompute"),
    (21, 10, 4, "swap"),
    (5, 0, 2, "swap"),
]


def _blocks_needed(prompt: list[int], block_size: int) -> int:
    return -(-(len(prompt) + MAX_TOKENS) // block_size)


def _config(model: str, block_size: int, prompts, scenario: dict) -> EngineConfig:
    args = {k: v for k, v in scenario.items() if k not in ("pool", "forced")}
    need = [_blocks_needed(p, block_size) for p in prompts]
    # "tight": about a third of what all requests need at once, so preemption must happen.
    num_blocks = max(max(need) + 2, sum(need) // 3) if scenario.get("pool") else sum(need) + 8
    return EngineConfig(
        model=model, block_size=block_size, num_blocks=num_blocks, debug_checks=True, **args
    )


def run_engine(engine: LLMEngine, prompts, params, forced=(), second_wave_after: int = 2):
    """Half the requests arrive first; the rest after `second_wave_after` steps, so they can hit
    the blocks the first wave published."""
    half = len(prompts) // 2
    driver = StepDriver(engine)
    for i in range(half):
        engine.add_request(str(i), prompts[i], params)
    outputs = {}
    steps = 0
    while engine.has_unfinished_requests() or len(outputs) < len(prompts):
        if steps == second_wave_after:
            for i in range(half, len(prompts)):
                engine.add_request(str(i), prompts[i], params)
            for index, after, resume, mode in forced:
                driver.force_preempt(str(index), after, resume, mode)
        for out in driver.step():
            if out.finished:
                outputs[int(out.request_id)] = out
        steps += 1
        assert steps < 5000, "engine made no progress"
    return [outputs[i] for i in range(len(prompts))]


def assert_idle_baseline(engine: LLMEngine) -> None:
    """Nothing held: every block free or cached, every cached block indexed, nothing swapped."""
    s = engine.stats()
    assert s["private_blocks"] == s["shared_blocks"] == 0, s
    assert s["evicting_blocks"] == s["restoring_blocks"] == 0, s
    assert s["free_blocks"] + s["cached_blocks"] == s["num_blocks"], s
    assert s["index_entries"] == s["cached_blocks"], s
    assert s["running"] == s["waiting"] == s["swapped"] == s["swap_space_used"] == 0, s
    assert not engine.cache.live_tables and not engine.cache.inflight
    engine.cache.check_invariants()


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("model_kind", ["builtin", "hf_gqa"])
def test_tokens_equal_reference(model_kind, scenario, block_size, hf_gqa_dir, references):
    model = "builtin:tiny-llama" if model_kind == "builtin" else hf_gqa_dir
    ref = references(model)
    vocab = ref.model.config.vocab_size
    prompts = prefix_prompts(block_size, vocab)
    spec = SCENARIOS[scenario]
    engine = LLMEngine(
        _config(model, block_size, prompts, spec),
        ref.model,
        None if model_kind == "hf_gqa" else _byte_tokenizer(),
    )
    outs = run_engine(engine, prompts, GREEDY, FORCED if spec.get("forced") else ())

    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        expected = ref.tokens(prompt, GREEDY)
        assert out.outputs[0].token_ids == expected, f"request {i} diverged ({scenario})"
        assert out.outputs[0].finish_reason == "length"
    stats = engine.stats()
    if spec.get("pool"):
        assert stats["preemptions"] > 0, "the tight pool did not force any preemption"
        if spec["preemption_mode"] == "swap":
            assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]
    if spec.get("forced"):
        preempted = {int(o.request_id) for o in outs if o.metrics.num_preemptions}
        assert {f[0] for f in FORCED} <= preempted
    if scenario == "prefix_on":
        assert stats["prefix_hits"] > 0
        assert any(o.metrics.num_cached_tokens for o in outs)
    if scenario == "prefix_off":
        assert stats["prefix_hits"] == 0 and stats["cached_blocks"] == 0
    assert_idle_baseline(engine)


def _byte_tokenizer():
    from kvpage.model.tokenizer import ByteTokenizer

    return ByteTokenizer()


def test_prefix_counters_count_each_prompt_once_under_preemption(references):
    """prefix_queries/prefix_hits: each request's prompt once, at its first admission; retries
    and re-prefills after recompute preemption add nothing."""
    ref = references("builtin:tiny-llama")
    prompts = prefix_prompts(8, ref.model.config.vocab_size, n=12, seed=5)
    cfg = _config("builtin:tiny-llama", 8, prompts, {"pool": "tight"})
    engine = LLMEngine(cfg, ref.model, _byte_tokenizer())
    outs = run_engine(engine, prompts, GREEDY)
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["prefix_queries"] == sum(len(p) for p in prompts)
    assert stats["prefix_hits"] == sum(o.metrics.num_cached_tokens for o in outs) > 0
