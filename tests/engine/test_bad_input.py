"""Bad input raises InvalidRequest naming the field, changes nothing, and the other requests in the
same batch still finish correctly."""

from __future__ import annotations

import pytest

from kvpage import LLM, InvalidRequest, LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.model import load_model

from .test_differential import assert_idle_baseline

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("builtin:tiny-llama")


BAD = {
    "empty prompt": ([], PARAMS, "empty"),
    "too long": ([5] * 5000, PARAMS, "context"),
    "max_tokens over context": ([5, 6], SamplingParams(max_tokens=4095), "max_tokens"),
    "out of vocabulary": ([5, 258, 7], PARAMS, "vocabulary"),
    "negative id": ([5, -1], PARAMS, "vocabulary"),
    "not ints": (["a", "b"], PARAMS, "token ids"),
    "params type": ([5, 6], {"max_tokens": 3}, "SamplingParams"),
    # 64 samples of one request would run in one step beyond max_num_seqs (64 is the default)
    "n over max_num_seqs": ([5, 6], SamplingParams(max_tokens=3, n=65), "max_num_seqs"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_fails_alone(tiny, case, references):
    prompt, params, needle = BAD[case]
    engine = LLMEngine(EngineConfig(block_size=16, num_blocks=64, debug_checks=True), *tiny)
    good = [tiny[1].encode("first good one"), tiny[1].encode("second good one")]
    engine.add_request("g0", good[0], PARAMS)
    with pytest.raises(InvalidRequest, match=needle):
        engine.add_request("bad", prompt, params)
    engine.add_request("g1", good[1], PARAMS)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"g0", "g1"}
    ref = references("builtin:tiny-llama")
    for rid, p in zip(("g0", "g1"), good, strict=True):
        assert done[rid].outputs[0].token_ids == ref.tokens(p, PARAMS)
    assert_idle_baseline(engine)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=0), "top_k"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_is_invalid_request():
    with pytest.raises(InvalidRequest, match="unknown builtin model"):
        LLM("builtin:no-such-model")
    with pytest.raises(InvalidRequest, match="not a directory"):
        LLM("/no/such/dir")


def test_duplicate_request_id_and_pool_too_small(tiny):
    engine = LLMEngine(EngineConfig(block_size=16, num_blocks=2), *tiny)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest, match="KV blocks"):
        engine.add_request("b", [1] * 40, SamplingParams(max_tokens=4))


def test_llm_generate_names_the_bad_prompt_and_leaves_nothing_queued():
    llm = LLM("builtin:tiny-llama", num_blocks=64, debug_checks=True)
    with pytest.raises(InvalidRequest, match=r"prompts\[1\]"):
        llm.generate(["fine", [], "also fine"], PARAMS, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate(["fine", "also fine"], PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        llm.tokenizer.encode(t) for t in ("fine", "also fine")
    ]
    assert all(o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids) for o in outs)
