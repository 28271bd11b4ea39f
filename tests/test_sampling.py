"""Sampling (R13): seeded draws are reproducible and depend on the request's own seed only;
top-k/top-p keep exactly the tokens they should."""

from __future__ import annotations

import pytest
import torch

from kvpage import SamplingParams
from kvpage.errors import InvalidRequest
from kvpage.model import load_model
from kvpage.sampling import filtered_probs, make_generator, sample_token, top_logprobs
from kvpage.verify.reference import generate


def test_params_validation():
    for bad in (
        dict(temperature=-1),
        dict(top_k=0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(max_tokens=0),
        dict(logprobs=-1),
    ):
        with pytest.raises(InvalidRequest):
            SamplingParams(**bad)


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0, 3.0])
    probs = filtered_probs(logits, top_k=2, top_p=1.0)
    assert set(torch.nonzero(probs).flatten().tolist()) == {1, 3}
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(20, generator=g) * 2
        top_p = float(torch.rand(1, generator=g).clamp(0.05, 0.95))
        probs = torch.softmax(logits, -1)
        order = torch.argsort(probs, descending=True).tolist()
        kept, mass = set(), 0.0
        for i in order:  # smallest prefix of the sorted tokens whose mass reaches top_p
            kept.add(i)
            mass += probs[i].item()
            if mass >= top_p:
                break
        got = set(torch.nonzero(filtered_probs(logits, -1, top_p)).flatten().tolist())
        assert got == kept


def test_sampling_follows_distribution():
    logits = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    params = SamplingParams(temperature=1.0, seed=5)
    gen = make_generator(params, 0)
    counts = (
        torch.bincount(
            torch.tensor([sample_token(logits, params, gen) for _ in range(3000)]), minlength=3
        ).float()
        / 3000
    )
    assert torch.allclose(counts, torch.tensor([0.1, 0.6, 0.3]), atol=0.04)


def test_seeded_reference_is_reproducible_and_seed_sensitive():
    model, tok = load_model("builtin:tiny-llama")
    prompt = tok.encode("seeded")
    runs = [
        generate(
            model,
            prompt,
            SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=s, ignore_eos=True),
        ).token_ids
        for s in (11, 11, 12)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stop_tokens_and_logprobs():
    model, tok = load_model("builtin:tiny-llama")
    prompt = tok.encode("stop here")
    free = generate(model, prompt, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3))
    assert len(free.logprobs) == 10 and all(len(lp) == 3 for lp in free.logprobs)
    assert all(free.token_ids[i] in free.logprobs[i] for i in range(10))  # greedy = top-1
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    stopped = generate(model, prompt, SamplingParams(max_tokens=10, stop_token_ids=(stop_at,)))
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    lp = top_logprobs(torch.tensor([1.0, 2.0]), 1)
    assert list(lp) == [1]


def test_prompt_validation():
    model, _ = load_model("builtin:tiny-llama")
    with pytest.raises(InvalidRequest, match="empty"):
        generate(model, [], SamplingParams())
    with pytest.raises(InvalidRequest, match="outside"):
        generate(model, [1, 999], SamplingParams())
    with pytest.raises(InvalidRequest, match="exceeds"):
        generate(model, [1], SamplingParams(max_tokens=10_000))
