"""The verification rule for one sequence's k drafts: which drafts the target keeps and the one
token it adds. Greedy keeps the longest prefix equal to the target's argmax; sampled is the
rejection rule of Leviathan et al. and Chen et al. (vLLM's rejection sampler), whose output is
distributed exactly as the target's, draft by draft.

Inputs are the target's logits rows for the k draft positions and the bonus position, (k+1, V):
row i scores the token after the context plus drafts[:i]. The result keeps what an oracle needs
to re-check every decision against p and q (issue 44, item 5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpage.sampling import filtered_probs
from kvpage.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampledDraws:
    """What a sampled verification computed and drew, enough to replay each decision."""

    target_probs: torch.Tensor  # (k+1, V) p after temperature, top-k, top-p
    draft_probs: torch.Tensor  # (k, V) q; a one-hot on the draft for n-gram drafts
    uniforms: torch.Tensor  # (k,) u_i: draft i is kept iff u_i < accept_probs[i]
    accept_probs: torch.Tensor  # (k,) min(1, p_i(x_i) / q_i(x_i))
    final_probs: torch.Tensor  # (V,) norm(max(0, p - q)) at the rejection, or p_{k+1}
    race: torch.Tensor  # (V,) exponentials: the final token is argmax(final_probs / race)


@dataclass(frozen=True, slots=True)
class Verification:
    tokens: list[int]  # kept drafts then the target's own token: 1..k+1 of them
    num_accepted: int  # drafts kept, 0..k
    draft_tokens: list[int]  # the k drafts as proposed
    greedy_targets: list[int] | None = None  # greedy: the target's argmax at the k+1 positions
    draws: SampledDraws | None = None  # sampled: p, q and the draws behind each decision


def verify_drafts(
    logits: torch.Tensor,
    draft_tokens: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> Verification:
    """logits: (k+1, V); draft_probs: (k, V), or None for drafts with no distribution (n-gram),
    which count as a one-hot q on the draft token, as vLLM treats them."""
    if logits.shape[0] != len(draft_tokens) + 1:
        raise ValueError(f"{len(draft_tokens)} drafts need {len(draft_tokens) + 1} logits rows")
    if draft_probs is not None and draft_probs.shape != (len(draft_tokens), logits.shape[-1]):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} is not (k, V)")
    if params.greedy:
        return verify_greedy(logits, draft_tokens)
    return verify_sampled(logits, draft_tokens, params, generator, draft_probs)


def verify_greedy(logits: torch.Tensor, draft_tokens: list[int]) -> Verification:
    """Keep drafts while each equals the target's argmax, then take the target's token. Ties go to
    the first maximum, as the engine's sampler (torch.max(...).indices), so a speculating greedy
    request picks the same token the plain one would."""
    targets = torch.max(logits, dim=-1).indices.tolist()  # (k+1,) one host sync
    kept = [d == t for d, t in zip(draft_tokens, targets[: len(draft_tokens)], strict=True)]
    num_accepted = _leading_true(kept)
    tokens = list(draft_tokens[:num_accepted]) + [targets[num_accepted]]
    return Verification(tokens, num_accepted, list(draft_tokens), greedy_targets=targets)


def verify_sampled(
    logits: torch.Tensor,
    draft_tokens: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> Verification:
    """The rejection rule. Draws from `generator`, always both and always in this order, whatever
    is accepted (so a replay takes the same ones, and the generator's state after a verification
    depends only on k and V):
      1. torch.rand(k) on the logits' device: u_1..u_k, draft i kept iff u_i < min(1, p_i/q_i);
      2. torch.empty(V).exponential_() on the logits' device: the race for the final token, which
         is argmax(final_probs / race), as kvpage.sampling.sample_token draws (with k = 0 this is
         exactly sample_token's single draw)."""
    k, vocab = len(draft_tokens), logits.shape[-1]
    p = target_probs(logits, params)  # (k+1, V)
    q = one_hot_probs(draft_tokens, vocab, p) if draft_probs is None else draft_probs.float()
    uniforms = torch.rand(k, generator=generator, device=logits.device)  # (k,)
    race = torch.empty(vocab, device=logits.device).exponential_(generator=generator)  # (V,)
    accept = acceptance_probs(p[:k], q, draft_tokens)  # (k,)
    num_accepted = _leading_true((uniforms < accept).tolist())
    final = final_probs(p, q, num_accepted)  # (V,)
    token = int(torch.argmax(final / race))
    draws = SampledDraws(p, q, uniforms, accept, final, race)
    tokens = list(draft_tokens[:num_accepted]) + [token]
    return Verification(tokens, num_accepted, list(draft_tokens), draws=draws)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(k+1, V) logits -> (k+1, V) probabilities, each row as kvpage.sampling.sample_token makes
    it (shift, temperature, top-k, top-p), so speculation samples what plain decoding would."""
    logits = logits.float()
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    return torch.stack([filtered_probs(row, params.top_k, params.top_p) for row in scaled])


def one_hot_probs(draft_tokens: list[int], vocab: int, like: torch.Tensor) -> torch.Tensor:
    """(k, V): q for drafts proposed without a distribution (n-gram lookup): all mass on the
    draft, so a draft is kept with probability p(x) and a rejection resamples p without x."""
    q = torch.zeros(len(draft_tokens), vocab, dtype=like.dtype, device=like.device)
    if draft_tokens:
        index = torch.tensor(draft_tokens, device=like.device).unsqueeze(1)  # (k, 1)
        q.scatter_(1, index, 1.0)
    return q


def acceptance_probs(p: torch.Tensor, q: torch.Tensor, draft_tokens: list[int]) -> torch.Tensor:
    """(k, V), (k, V) -> (k,) min(1, p_i(x_i) / q_i(x_i)). A draft its own q gave no mass could
    not have been drawn from q; rather than divide by 0 it is kept iff p allows it."""
    rows = torch.arange(len(draft_tokens), device=p.device)
    drafts = torch.tensor(draft_tokens, dtype=torch.long, device=p.device)
    p_x, q_x = p[rows, drafts], q[rows, drafts]
    ratio = torch.where(
        q_x > 0, p_x / q_x.clamp_min(torch.finfo(q.dtype).tiny), (p_x > 0).to(p.dtype)
    )
    return ratio.clamp(max=1.0)


def final_probs(p: torch.Tensor, q: torch.Tensor, num_accepted: int) -> torch.Tensor:
    """(k+1, V), (k, V) -> (V,): what the token after the kept drafts is drawn from. Every draft
    kept: the bonus row p_{k+1}, as plain sampling would; else the rejected row's residual."""
    if num_accepted == q.shape[0]:
        return p[num_accepted]
    return residual_probs(p[num_accepted], q[num_accepted])


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(V,), (V,) -> (V,) norm(max(0, p - q)): the mass p has beyond q, which a rejection must
    draw from for the output to follow p. Where p <= q everywhere (p == q up to rounding) a
    rejection had probability ~0; p itself is the limit and keeps the draw defined."""
    residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def _leading_true(flags: list[bool]) -> int:
    """How many flags are True before the first False."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)
