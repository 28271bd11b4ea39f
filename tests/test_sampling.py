"""Sampling: seeded draws are reproducible and depend on the request's own seed only;
top-k/top-p keep exactly the tokens they should."""

from __future__ import annotations

import pytest
import torch

from kvpage import SamplingParams
from kvpage.errors import InvalidRequest
from kvpage.model import load_model
from kvpage.reference.generator import generate
from kvpage.sampling import filtered_probs, make_generator, sample_token, top_logprobs


def test_params_validation():
    for bad in (
        dict(temperature=-1),
        dict(top_k=0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(max_tokens=-1),
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


# --- no NaN from tiny temperature or top_p; the chosen token's logprob -------------------------
def test_tiny_temperature_is_greedy_and_stored_as_zero():
    """vLLM treats a temperature below 1e-5 as greedy; stored as 0 so the sampler, the reference
    and the verifier's oracle all see greedy."""
    for t in (1e-6, 1e-40, 5e-324):
        params = SamplingParams(temperature=t, seed=1)
        assert params.greedy and params.temperature == 0.0
        assert make_generator(params, 0) is None
    assert not SamplingParams(temperature=1e-5).greedy


def test_large_logits_at_small_temperature_never_give_nan():
    """logits / T used to overflow to inf and the softmax to NaN, which drew token 0."""
    logits = torch.tensor([0.0, 3e35, 1e35, -3e38])
    for t in (1e-5, 1e-4, 0.5):
        params = SamplingParams(temperature=t, seed=0)
        assert sample_token(logits, params, make_generator(params, 0)) == 1
    probs = filtered_probs((logits - logits.max()) / 1e-4, -1, 0.9)
    assert not torch.isnan(probs).any() and probs[1] == 1.0


def test_tiny_top_p_keeps_the_top_token():
    """A top_p below float32's smallest value compared as 0, and `mass before >= 0` dropped every
    token (NaN probabilities)."""
    logits = torch.tensor([0.5, 2.0, 1.0])
    for top_p in (1e-50, 1e-300, 1e-8):
        probs = filtered_probs(logits, -1, top_p)
        assert probs.tolist() == [0.0, 1.0, 0.0]
        params = SamplingParams(temperature=1.0, top_p=top_p, seed=2)
        gen = make_generator(params, 0)
        assert {sample_token(logits, params, gen) for _ in range(20)} == {1}


def test_seed_range_is_checked_up_front():
    """torch's manual_seed takes [-(2**63), 2**64 - 1]; a seed outside it used to fail inside the
    engine after the request held a block table. Sample i seeds with seed + i."""
    for seed in (2**64, -(2**63) - 1, 2**100):
        with pytest.raises(InvalidRequest, match="^seed"):
            SamplingParams(temperature=1.0, seed=seed)
    with pytest.raises(InvalidRequest, match="^seed"):
        SamplingParams(temperature=1.0, seed=2**64 - 2, n=3)
    for bad in (True, 1.5, "7"):
        with pytest.raises(InvalidRequest, match="^seed"):
            SamplingParams(seed=bad)
    for seed, n in ((2**64 - 1, 1), (-(2**63), 1), (2**64 - 3, 3)):
        params = SamplingParams(temperature=1.0, seed=seed, n=n)
        make_generator(params.for_sample(n - 1), 0)  # does not raise


def test_non_finite_temperature_is_rejected():
    for bad in (float("inf"), float("nan"), True):
        with pytest.raises(InvalidRequest, match="^temperature"):
            SamplingParams(temperature=bad)


def test_engine_reports_the_chosen_tokens_logprob_outside_the_top_k():
    """OpenAI and vLLM report the sampled token's logprob even when it is not among the top k;
    the top-k dict stays exactly the k most likely raw tokens (what the verifier checks)."""
    from kvpage import LLM
    from kvpage.verify.sampling_oracle import check_logprobs

    model, tok = load_model("builtin:tiny-llama")
    prompt = tok.encode("hot sampling")
    params = SamplingParams(temperature=3.0, seed=9, max_tokens=16, ignore_eos=True, logprobs=1)
    ref = generate(model, prompt, params)
    out = LLM("builtin:tiny-llama").generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids
    assert len(out.token_logprobs) == len(out.logprobs) == 16
    outside = 0
    for token, logits, top, chosen in zip(
        out.token_ids, ref.step_logits, out.logprobs, out.token_logprobs, strict=True
    ):
        assert check_logprobs(logits, top, 1) is None
        assert chosen == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)
        outside += token not in top
    assert outside > 0  # the case really samples outside the top 1
