"""Traces of a quantized engine (issue 14 §4): every cache view records the stored KV dtype, the
layout version and, per block, a digest of the scales the step read (one part per layer), lined up
with the reference's digests for the same tokens."""

from __future__ import annotations

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.model import load_model
from kvpage.verify.reference import generate
from kvpage.verify.trace import EngineTracer

PROMPT = list(range(40, 61))  # 21 tokens: 2 full blocks of 8 and a partial one


def _traced(kv_cache_dtype: str):
    model, tok = load_model("builtin:tiny-llama")
    cfg = EngineConfig("builtin:tiny-llama", block_size=8, num_blocks=16,
                       kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(cfg, model, tok)
    engine.add_observer(EngineTracer(engine))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("r", PROMPT, params)
    while engine.has_unfinished_requests():
        engine.step()
    ref = generate(model, PROMPT, params, trace_as="ref", kv_cache_dtype=kv_cache_dtype,
                   scale_span=8)
    return engine, engine.tracer.records["r"], ref.records


def test_int8_views_record_dtype_layout_and_scales_per_block_and_layer():
    engine, cand, ref = _traced("int8")
    layers = engine.model.config.num_layers
    for c, r in zip(cand, ref, strict=True):
        view = c.view
        assert (view.kv_dtype, view.kv_layout) == ("int8", 2)
        assert (r.view.kv_dtype, r.view.kv_layout) == ("int8", 2)
        assert view.scale_digests == tuple(e.scale for e in view.entries)
        assert len(view.scale_digests) == len(view.entries) == len(r.view.scale_digests)
        assert all(len(d.split(".")) == layers for d in view.scale_digests)
        # layer 0's K/V do not depend on attention: their scales equal the reference's exactly
        for mine, theirs in zip(view.scale_digests, r.view.scale_digests, strict=True):
            assert mine.split(".")[0] == theirs.split(".")[0]
    # what a step read is what the pool held then: the last view covers every context token
    assert sum(e.valid_len for e in cand[-1].view.entries) == len(PROMPT) + len(cand) - 1


def test_unquantized_views_have_no_scales():
    _, cand, ref = _traced("auto")
    for c, r in zip(cand, ref, strict=True):
        assert (c.view.kv_dtype, c.view.kv_layout, c.view.scale_digests) == ("float32", 1, ())
        assert all(e.scale == "" for e in c.view.entries)
        assert r.view.scale_digests == ()
