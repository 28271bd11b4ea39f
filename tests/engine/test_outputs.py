"""Streaming outputs: a progress output carries only the step's new tokens and their
logprobs, from output position `offset`; the finished output is complete. Copying the whole list
into every progress output made a request's streaming cost quadratic in its length."""

from __future__ import annotations

import pytest

from kvpage import LLM, LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.model import load_model

from .workload import prefix_prompts

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL)


def _outputs(engine: LLMEngine, request_id: str, prompt, params) -> list:
    engine.add_request(request_id, prompt, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    return seen


def test_progress_outputs_hold_only_the_step(tiny):
    engine = LLMEngine(EngineConfig(model=MODEL, block_size=16), *tiny)
    prompt = prefix_prompts(16, 258, n=2, seed=1)[1]
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    *progress, final = _outputs(engine, "r", prompt, params)
    assert final.finished and not any(o.finished for o in progress)
    (done,) = final.outputs
    assert len(done.token_ids) == 20 and done.offset == 0 and done.text
    assert len(done.logprobs) == len(done.token_logprobs) == 20
    assert len(progress) == 19  # the last token comes with the finished output
    for position, out in enumerate(progress):
        (c,) = out.outputs
        assert c.offset == position and c.token_ids == out.new_token_ids == [
            done.token_ids[position]
        ]
        assert c.logprobs == [done.logprobs[position]] and c.text == ""
        assert c.token_logprobs == [done.token_logprobs[position]]
    assert final.new_token_ids == done.token_ids[-1:]


def test_parallel_progress_is_per_sample_deltas(tiny):
    engine = LLMEngine(EngineConfig(model=MODEL, block_size=8), *tiny)
    prompt = prefix_prompts(16, 258, n=2, seed=2)[1][:13]
    params = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    *progress, final = _outputs(engine, "p", prompt, params)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for out in progress:
        (c,) = out.outputs
        assert c.offset == len(streamed[c.index]) and len(c.token_ids) == 1
        streamed[c.index] += c.token_ids
    assert final.finished and [c.token_ids for c in final.outputs] == [streamed[0], streamed[1]]
    assert all(c.offset == 0 and len(c.token_ids) == 6 for c in final.outputs)


def test_offline_generate_is_complete():
    llm = LLM(MODEL, block_size=16)
    prompts = prefix_prompts(16, 258, n=3, seed=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 9 and o.outputs[0].offset == 0 for o in outs)
