"""Greedy speculative decoding is lossless: with n-gram drafts and with the target's own int8 copy
as its draft model, every request's tokens equal those of the same engine decoding plainly, on
Llama, Qwen3 and Gemma 3 shapes (Gemma 3: global and sliding-window layer groups), under prefix
caching with a second wave hitting the first wave's blocks (blocks a speculating request wrote),
a pool tight enough to preempt by recompute or by swap, forced preemption between speculative
steps, int8 KV, and n = 2. Blocks of 8 tokens and k = 3 drafts: drafts cross block boundaries. The
invariant checker runs after every step (debug_checks)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig

from ..engine.test_differential import FORCED, MAX_TOKENS, _config, run_engine
from ..engine.workload import prefix_prompts
from ..model.hf_models import VOCAB, save_hf

BLOCK = 8
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
SELF_DRAFT = {
    "method": "draft_model",
    "model": None,
    "quantization": "int8",
    "num_speculative_tokens": 3,
}
SCENARIOS = {
    "prefix_recompute": dict(enable_prefix_caching=True, preemption_mode="recompute", pool="tight"),
    "swap_forced": dict(preemption_mode="swap", swap_space_blocks=512, forced=True),
    # int8 KV: one scale per token, so a rolled-back slot leaves no scale behind
    "int8_kv": dict(kv_cache_dtype="int8", preemption_mode="recompute", pool="tight"),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            directory = tmp_path_factory.mktemp(name)
            save_hf(name, directory)
            made[name] = str(directory)
        return made[name]

    return get


def _tokens(model: str, scenario: dict, spec: dict | None, params: SamplingParams, n: int = 12):
    prompts = prefix_prompts(BLOCK, VOCAB, n=n)
    config = replace(_config(model, BLOCK, prompts, scenario), speculative_config=spec)
    engine = LLMEngine(config)
    forced = FORCED[:2] if scenario.get("forced") else ()
    outs = run_engine(engine, prompts, params, forced)
    return [[c.token_ids for c in o.outputs] for o in outs], engine.stats()


@pytest.mark.parametrize("family", ["llama-gqa-8q-2kv", "qwen3", "gemma3"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "self_int8"])
def test_greedy_tokens_equal_plain_decoding(family, scenario, spec, hf_dirs):
    model = hf_dirs(family)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain, _ = _tokens(model, SCENARIOS[scenario], None, params)
    fast, stats = _tokens(model, SCENARIOS[scenario], spec, params)
    assert fast == plain
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats  # it did speculate, and kept some
    if spec is NGRAM:  # the int8 copy may agree with the target on every draft
        assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    if SCENARIOS[scenario].get("pool") or SCENARIOS[scenario].get("forced"):
        assert stats["preemptions"] > 0, stats


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_another_draft_model_rejecting_often(scenario, hf_dirs):
    """A draft model of other weights (same vocabulary): most drafts are rejected, so the draft's
    own KV is rolled back nearly every step, and the target's too."""
    model = hf_dirs("llama-gqa-8q-2kv")
    spec = {"method": "draft_model", "model": hf_dirs("llama-mha"), "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain, _ = _tokens(model, SCENARIOS[scenario], None, params)
    fast, stats = _tokens(model, SCENARIOS[scenario], spec, params)
    assert fast == plain
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"] / 2


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "self_int8"])
def test_parallel_samples_greedy_equal_plain(spec, hf_dirs):
    """n = 2: both samples fork off one prefill, then each speculates on its own."""
    model = hf_dirs("llama-gqa-8q-2kv")
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, ignore_eos=True)
    scenario = SCENARIOS["prefix_recompute"]
    plain, _ = _tokens(model, scenario, None, params, n=6)
    fast, stats = _tokens(model, scenario, spec, params, n=6)
    assert fast == plain
    assert all(len(o) == 2 for o in fast)
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "self_int8"])
def test_a_hit_on_blocks_a_speculating_request_wrote(spec, hf_dirs):
    """Request B's prompt is request A's prompt and output: B hits the blocks A's speculative
    steps wrote and published, and its tokens equal those of a plain engine, where B computes
    every token of its prompt itself (no cache)."""
    model = hf_dirs("qwen3")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    a_prompt = prefix_prompts(BLOCK, VOCAB, n=2)[1]
    engine = LLMEngine(
        EngineConfig(
            model=model, block_size=BLOCK, num_blocks=64, debug_checks=True, speculative_config=spec
        )
    )
    a = run_engine(engine, [a_prompt], params)[0].outputs[0].token_ids
    b_prompt = a_prompt + a[: MAX_TOKENS - 5]
    b = run_engine(engine, [b_prompt], params)[0]
    plain = LLMEngine(
        EngineConfig(model=model, block_size=BLOCK, num_blocks=64, enable_prefix_caching=False)
    )
    assert b.outputs[0].token_ids == run_engine(plain, [b_prompt], params)[0].outputs[0].token_ids
    hit_blocks = b.metrics.num_cached_tokens // BLOCK
    assert hit_blocks * BLOCK > len(a_prompt) + BLOCK, b.metrics  # blocks of A's output were hit
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
