"""A seeded request draws the same tokens alone and in a batch of 16, and those are the
reference's tokens."""

from __future__ import annotations

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.model import load_model

from .test_differential import assert_idle_baseline, run_engine
from .workload import prefix_prompts


def _engine(model, tok, **kw) -> LLMEngine:
    cfg = EngineConfig(block_size=16, num_blocks=256, debug_checks=True, **kw)
    return LLMEngine(cfg, model, tok)


def test_seeded_sampling_alone_equals_batch_equals_reference(references):
    model, tok = load_model("builtin:tiny-llama")
    ref = references("builtin:tiny-llama")
    prompts = prefix_prompts(16, model.config.vocab_size, n=16, seed=3)
    params = [
        SamplingParams(
            temperature=0.8, top_p=0.95, top_k=50, max_tokens=32, seed=100 + i, ignore_eos=True
        )
        for i in range(16)
    ]
    batch = _engine(model, tok)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        batch.add_request(str(i), p, sp)
    outs = {}
    while batch.has_unfinished_requests():
        for o in batch.step():
            if o.finished:
                outs[int(o.request_id)] = o.outputs[0].token_ids
    for i in (0, 7, 15):
        alone = _engine(model, tok)
        alone.add_request("x", prompts[i], params[i])
        solo = None
        while alone.has_unfinished_requests():
            for o in alone.step():
                solo = o.outputs[0].token_ids if o.finished else solo
        assert solo == outs[i], f"request {i}: tokens depend on batch neighbours"
    for i in range(16):
        assert outs[i] == ref.tokens(prompts[i], params[i]), f"request {i} != reference"
    assert len({tuple(t) for t in outs.values()}) == 16  # different seeds, different draws
    assert_idle_baseline(batch)


def test_sampled_under_preemption(references):
    """Recompute preemption must not redraw tokens: the generator state survives it."""
    model, tok = load_model("builtin:tiny-llama")
    ref = references("builtin:tiny-llama")
    prompts = prefix_prompts(16, model.config.vocab_size, n=12, seed=4)
    params = SamplingParams(temperature=0.8, max_tokens=40, seed=7, ignore_eos=True)
    engine = LLMEngine(EngineConfig(block_size=16, num_blocks=20, debug_checks=True), model, tok)
    outs = run_engine(engine, prompts, params)
    assert engine.stats()["preemptions"] > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == ref.tokens(p, params)
