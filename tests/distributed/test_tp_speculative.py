"""Speculative decoding under tensor parallelism: n-gram drafts verified by a TP=2 target give
the greedy tokens of plain TP=1 decoding (the verification rows are part of the one broadcast
step), under a pool tight enough to preempt; a draft model under TP is refused by name."""

from __future__ import annotations

import pytest

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.errors import InvalidConfig
from tests.engine.workload import prefix_prompts

from .conftest import engine_for

BLOCK = 8
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _tokens(engine, prompts) -> tuple[list[list[int]], dict]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[int(o.request_id)] = o.outputs[0].token_ids
    return [out[i] for i in range(len(prompts))], engine.stats()


def test_ngram_speculation_under_tp2_equals_plain_decoding(hf_dirs):
    directory = str(hf_dirs["llama-gqa-8q-2kv"][1])
    prompts = prefix_prompts(BLOCK, 258, n=8)
    base = dict(model=directory, block_size=BLOCK, num_blocks=20, preemption_mode="recompute")
    plain, _ = _tokens(LLMEngine(EngineConfig(**base)), prompts)
    config = EngineConfig(**base, tensor_parallel_size=2, speculative_config=NGRAM)
    with engine_for(config) as engine:
        fast, stats = _tokens(engine, prompts)
    assert fast == plain
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["preemptions"] > 0, stats


def test_a_draft_model_under_tp_is_refused_by_name():
    spec = {
        "method": "draft_model",
        "model": None,
        "quantization": "int8",
        "num_speculative_tokens": 2,
    }
    with pytest.raises(InvalidConfig, match="tensor_parallel_size 1"):
        LLMEngine(EngineConfig(tensor_parallel_size=2, speculative_config=spec))
