"""Prompt logprobs against transformers' full-prompt logits on the same random weights: alone,
with prefix caching on and the prompt's blocks already cached, in chunks, under preemption."""

from __future__ import annotations

import pytest
import torch

from kvpage import LLM, EngineConfig, LLMEngine, SamplingParams
from kvpage.errors import InvalidRequest

from ..model.hf_models import VOCAB, save_hf

TOL = 1e-4  # fp32 on both sides
K = 5


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf-llama")
    model = save_hf("llama-mha", directory)
    return model, str(directory)


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def _expected(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _engine(directory: str, **kw) -> LLMEngine:
    cfg = dict(model=directory, block_size=16, num_blocks=64, debug_checks=True)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams, between=None):
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if between is not None:
            between(engine)
    return done


def _max_error(hf_model, ids: list[int], rows, k: int) -> float:
    """Checks the shape exactly (None first, the token itself, top k by transformers) and
    returns the largest |logprob difference|."""
    expected = _expected(hf_model, ids)  # (L, V): row p scores token p + 1
    assert len(rows) == len(ids) and rows[0] is None
    worst = 0.0
    for p, row in enumerate(rows[1:]):
        ref = expected[p]
        token = ids[p + 1]
        top_ids = torch.topk(ref, k).indices.tolist() if k else []
        assert token in row
        assert set(row) == {*top_ids, token}, f"position {p + 1}: top-{k} set differs"
        for t, lp in row.items():
            worst = max(worst, abs(lp - ref[t].item()))
    return worst


def test_prompt_logprobs_match_transformers_and_a_cached_prefix(hf):
    hf_model, directory = hf
    engine = _engine(directory)
    params = SamplingParams(max_tokens=2, prompt_logprobs=K)
    shared = _prompt(40, 1)
    first = shared + _prompt(9, 2)
    second = shared + _prompt(13, 3)
    out1 = _run(engine, {"a": first}, params)["a"]
    # plain request of the same prefix: its blocks cached, a hit for anyone who may take it
    _run(engine, {"warm": shared + [5]}, SamplingParams(max_tokens=1))
    assert engine.stats()["cached_blocks"] >= 2
    out2 = _run(engine, {"b": second}, params)["b"]
    out3 = _run(engine, {"c": first}, params)["c"]  # the very same prompt again
    errs = [
        _max_error(hf_model, ids, out.prompt_logprobs, K)
        for ids, out in ((first, out1), (second, out2), (first, out3))
    ]
    assert max(errs) <= TOL, errs
    # a kept its rows beside its 3 full blocks (k = 5). b shares the first 2 blocks with it
    # (the second block's last row scores token 32, still shared), c the very same 3 blocks:
    # their hits are served the kept rows, and the rows still match transformers.
    assert [o.metrics.num_cached_tokens for o in (out1, out2, out3)] == [0, 32, 48]
    assert engine.scheduler.prompt_rows.served_blocks == 2 + 3
    # ... and a plain request takes the prefix b published past the shared blocks.
    plain = _run(engine, {"d": second}, SamplingParams(max_tokens=1))["d"]
    assert plain.metrics.num_cached_tokens == 48
    assert plain.prompt_logprobs is None


def test_kept_rows_serve_only_what_they_hold(hf):
    """Rows kept with a smaller k, or whose block's last row scored another next token, are
    recomputed: the hit stops before that block, and every row still matches transformers."""
    hf_model, directory = hf
    engine = _engine(directory)
    shared = _prompt(32, 50)  # exactly 2 blocks
    first, other = shared + _prompt(9, 51), shared + _prompt(9, 52)
    assert first[32] != other[32]
    ks = {"k1": 1, "k3": 3, "k2": 2, "next": 0}
    outs = {}
    for rid, k in ks.items():
        ids = other if rid == "next" else first
        outs[rid] = _run(engine, {rid: ids}, SamplingParams(max_tokens=1, prompt_logprobs=k))[rid]
    hits = {rid: out.metrics.num_cached_tokens for rid, out in outs.items()}
    # k1 kept k = 1; k3 wants more: no hit, and keeps k = 3; k2 is served those.
    assert hits["k1"] == hits["k3"] == 0 and hits["k2"] == 32
    # next: the second block's last row scored first[32]; other[32] is served from the kept
    # top 3 only if transformers ranks it there, else that block is scored again.
    top3 = torch.topk(_expected(hf_model, first)[31], 3).indices.tolist()
    assert hits["next"] == (32 if other[32] in top3 else 16)
    for rid, out in outs.items():
        ids = other if rid == "next" else first
        assert _max_error(hf_model, ids, out.prompt_logprobs, ks[rid]) <= TOL


def test_rows_of_an_evicted_block_are_never_served(hf):
    """Rows are valid only for the block incarnation they were computed for: after the pool
    reused a's blocks and a plain request cached the same prompt again in other ones, a
    prompt-logprob request on it gets no hit (no rows were kept for the new blocks)."""
    hf_model, directory = hf
    engine = _engine(directory, num_blocks=6)
    ids = _prompt(40, 60)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    first = _run(engine, {"a": ids}, params)["a"]
    for i in range(4):  # other prompts fill the pool: a's blocks are evicted and reused
        _run(engine, {f"f{i}": _prompt(70, 61 + i)}, SamplingParams(max_tokens=1))
    assert (
        _run(engine, {"plain": ids}, SamplingParams(max_tokens=1))[
            "plain"
        ].metrics.num_cached_tokens
        == 0
    )
    again = _run(engine, {"b": ids}, params)["b"]
    assert again.metrics.num_cached_tokens == 0
    assert _run(engine, {"c": ids}, params)["c"].metrics.num_cached_tokens == 32  # b's rows
    assert len(engine.scheduler.prompt_rows) >= 1  # a's rows are still in the store, dead
    for out in (first, again):
        assert _max_error(hf_model, ids, out.prompt_logprobs, 2) <= TOL


def test_prompt_logprobs_in_chunks_and_a_batch(hf):
    hf_model, directory = hf
    engine = _engine(directory, max_num_batched_tokens=24)  # prompts of 50 tokens: 3 chunks
    prompts = {f"r{i}": _prompt(50, 10 + i) for i in range(3)}
    prompts["same"] = prompts["r0"]
    done = _run(engine, prompts, SamplingParams(max_tokens=3, prompt_logprobs=0))
    for rid, ids in prompts.items():
        assert _max_error(hf_model, ids, done[rid].prompt_logprobs, 0) <= TOL


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_under_preemption(hf, mode):
    hf_model, directory = hf
    engine = _engine(directory, max_num_batched_tokens=16)
    ids = _prompt(45, 20)
    preempted = []

    def preempt_once(eng: LLMEngine) -> None:
        seq = eng.seqs.get("p")
        if not preempted and seq is not None and seq.num_computed >= 16 and not seq.finished:
            preempted.append(eng.preempt("p", mode))

    out = _run(engine, {"p": ids}, SamplingParams(max_tokens=4, prompt_logprobs=3), preempt_once)
    assert preempted and out["p"].metrics.num_preemptions == 1
    assert _max_error(hf_model, ids, out["p"].prompt_logprobs, 3) <= TOL


def test_prompt_logprobs_with_parallel_samples(hf):
    hf_model, directory = hf
    engine = _engine(directory)
    ids = _prompt(20, 30)
    params = SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=4, prompt_logprobs=2)
    out = _run(engine, {"n": ids}, params)["n"]
    assert len(out.outputs) == 3
    assert _max_error(hf_model, ids, out.prompt_logprobs, 2) <= TOL


def test_bad_prompt_logprobs_are_refused(hf):
    _, directory = hf
    engine = _engine(directory)
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidRequest, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        engine.add_request("x", [3, 4, 5], SamplingParams(prompt_logprobs=VOCAB + 1))
    assert not engine.has_unfinished_requests()


def test_llm_generate_returns_prompt_logprobs(hf):
    """The offline API, vLLM's way: LLM.generate with SamplingParams(prompt_logprobs=k)."""
    hf_model, directory = hf

    llm = LLM(directory, num_blocks=32)
    prompts = [_prompt(18, 40), _prompt(18, 40)[:9] + _prompt(9, 41)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=1))
    for ids, out in zip(prompts, outs, strict=True):
        assert _max_error(hf_model, ids, out.prompt_logprobs, 1) <= TOL
    plain = llm.generate(prompts[0], SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None
