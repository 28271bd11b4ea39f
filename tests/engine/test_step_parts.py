"""The step's parts apart from the engine façade: the sampler's draws and the fork of a parallel
request (over the model-free scheduler harness), and the runner's result, which leaves the batch
it was given as it was."""

from __future__ import annotations

import dataclasses

import torch

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.engine.requests import NewRequest
from kvpage.engine.sampler import Sampler
from kvpage.sampling_params import SamplingParams

from .test_scheduler import NS, Harness, sampling, tokens

V = 50  # the fake vocabulary of the sampler tests


def _draw_first_tokens(h: Harness, logits: torch.Tensor):
    """Schedule and commit one step, then let the real sampler draw from `logits`."""
    plan = h.plan()
    rows = [item for item in plan.scheduled if sampling(item)]
    h.sched.commit(plan)
    return Sampler(h.sched).draw(rows, logits[: len(rows)])


def test_a_parallel_request_forks_at_its_first_token_and_each_sample_draws_from_its_row():
    """a (n=3) and b share a step: a's samples 1 and 2 are made then, run right after a, and
    draw their first token from a's row; every greedy token is its row's argmax. Fails if the
    fork is drawn from another row, made twice, or made for a request with n == 1."""
    h = Harness()
    h.add("a", tokens(10, 6), n=3)
    h.add("b", tokens(30, 5))
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    sampled = _draw_first_tokens(h, logits)
    best = logits.argmax(dim=-1).tolist()
    a = h.requests.samples["a"][0]
    assert [(d.seq.sample_id, d.row, d.parent, d.token) for d in sampled.forked] == [
        ("a#1", 0, a, best[0]),
        ("a#2", 0, a, best[0]),
    ]
    assert [(d.seq.sample_id, d.row, d.token) for d in sampled.draws] == [
        ("a#0", 0, best[0]),
        ("b", 1, best[1]),
    ]
    assert [s.sample_id for s in h.sched.running] == ["a#0", "a#1", "a#2", "b"]
    assert not h.sched.to_fork  # forked once


def test_a_draw_carries_the_logprobs_its_request_asked_for():
    """Top-k logprobs and the chosen token's own, from log_softmax of its row; none for a
    request that did not ask."""
    h = Harness()
    params = SamplingParams(max_tokens=16, logprobs=3)
    h.sched.add(
        h.requests.new_sequence(NewRequest("a", tokens(10, 5), params, None, 0.0, None), NS)
    )
    h.add("b", tokens(30, 5))
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    sampled = _draw_first_tokens(h, logits)
    a, b = sampled.draws
    logprobs = torch.log_softmax(logits[0], dim=-1)
    top = torch.topk(logprobs, 3)
    assert a.top_logprobs == dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    assert a.logprob == float(logprobs[a.token]) and a.token == int(logits[0].argmax())
    assert b.top_logprobs is None and b.logprob is None


def _fields(batch) -> dict:
    """A copy of every field of the batch (lists copied, so a write into one shows)."""
    return {
        f.name: list(v) if isinstance(v, list) else v
        for f in dataclasses.fields(batch)
        for v in [getattr(batch, f.name)]
    }


def test_the_runner_returns_its_logits_and_leaves_the_batch_as_given():
    """One step of a prompt-logprob request beside a plain one: the executor's result holds the
    sampling rows' logits (one per sequence) and the prompt rows' (one per prompt token after
    the first), and the batch's fields are what they were before the run."""
    engine = LLMEngine(EngineConfig(model="builtin:tiny-llama", seed=0))
    p, q = tokens(3, 17), tokens(5, 7)
    engine.add_request("p", p, SamplingParams(max_tokens=1, prompt_logprobs=2))
    engine.add_request("q", q, SamplingParams(max_tokens=1))
    plan = engine.scheduler.schedule(1)
    engine.scheduler.block_ops_applied(plan, engine.executor.apply_block_ops(plan.block_ops))
    batch = engine.executor.build(plan)
    before = _fields(batch)
    try:
        out = engine.executor.run(batch)
    finally:
        engine.executor.release(batch)
    assert _fields(batch) == before
    vocab = engine.model.config.vocab_size
    assert out.logits.shape == (2, vocab) and out.logits.dtype == torch.float32
    assert out.prompt_logits.shape == (len(p) - 1, vocab)
