"""Turning one step's logits into a token. Shared by the reference and the engine so that a seeded
request draws the same tokens on both; it holds no cache or scheduling state."""

from __future__ import annotations

import torch

from kvpage.sampling_params import SamplingParams

DEFAULT_SEED = 0


def make_generator(params: SamplingParams, fallback_seed: int, device: str | torch.device = "cpu"):
    """Per-request generator: a request's draws depend only on its own seed, never on its batch."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else fallback_seed
    return torch.Generator(device=device).manual_seed(seed)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """logits: (V,) -> token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float()
    # Shifted so the largest is 0 before dividing: a small temperature cannot overflow to inf
    # (inf - inf is NaN in the softmax), and the softmax is the same.
    scaled = (logits - logits.max()) / params.temperature
    probs = filtered_probs(scaled, params.top_k, params.top_p)
    # Exponential race (Gumbel-max in disguise): argmax p_i / E_i draws i with probability p_i,
    # one draw from the request's own generator per step.
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / race))


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax over the tokens that survive top-k then top-p; others get probability 0."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly before it already reach top_p. The first always
        # stays, said outright: a top_p below float32's smallest value rounds to 0, and 0 >= 0.
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def top_logprobs(logits: torch.Tensor, k: int) -> dict[int, float]:
    """The k most likely tokens of the model's raw distribution and their log-probabilities."""
    return _top(torch.log_softmax(logits.float(), dim=-1), k)


def chosen_logprobs(logits: torch.Tensor, k: int, token: int) -> tuple[dict[int, float], float]:
    """`top_logprobs(logits, k)` and the raw log-probability of the token actually chosen, which
    OpenAI reports even when it is outside the top k (a sampled, unlikely token)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return _top(logprobs, k), float(logprobs[token])


def _top(logprobs: torch.Tensor, k: int) -> dict[int, float]:
    values, ids = torch.topk(logprobs, k)
    return dict(zip(ids.tolist(), values.tolist(), strict=True))
