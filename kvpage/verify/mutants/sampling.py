"""Sampling mutants: engine-only bugs in how ONE engine instance draws its tokens, planted
through the sampler seam and the scheduler's public `preempt`. The reference imports
kvpage.sampling directly and stays correct, so the differential diff sees the engine drift; the
first divergence must be attributed to "sampling".

A bug inside kvpage.sampling itself would be wrong on both sides alike; catching those is the
sampling oracle's job (kvpage.verify.sampling_oracle), not a mutant's.

The workload must exercise the bug: several seeded requests in one batch (shared generator), a
recompute preemption of a seeded request (reseeding), a temperature away from 1 with top_p < 1
(top-p before temperature) and a small top_k whose (k+1)-th token has real mass (off by one)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpage.engine.engine import LLMEngine
from kvpage.engine.sequence import Sequence
from kvpage.sampling import filtered_probs, make_generator, sample_token
from kvpage.sampling_params import SamplingParams
from kvpage.verify.mutants.base import bind, mutant_table, plant

ProbsFn = Callable[[torch.Tensor, SamplingParams], torch.Tensor]  # (V,) logits -> (V,) probs


# --- buggy filters (also planted into kvpage.sampling by the oracle's tests) ---------------------
def probs_top_p_before_temperature(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The support is cut on the untempered logits, then the tempered softmax is taken over it."""
    support = filtered_probs(logits.float(), params.top_k, params.top_p) > 0
    tempered = logits.float() / params.temperature
    return torch.softmax(tempered.masked_fill(~support, float("-inf")), dim=-1)


def probs_top_k_off_by_one(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """top_k keeps k + 1 tokens."""
    top_k = params.top_k + 1 if params.top_k > 0 else params.top_k
    return filtered_probs(logits.float() / params.temperature, top_k, params.top_p)


def race_draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """The engine's own draw (one exponential race per step), so a mutant consumes the generator
    exactly as the correct sampler does and differs only in the probabilities it races."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / race))


# --- the mutants ---------------------------------------------------------------------------------
def masked_first(sampler, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The honest sampler's first rule, kept by every sampling mutant: constrained rows masked
    by their grammar (a mask dropped or misplaced is a bug of its own, kvpage.verify.mutants
    .structured)."""
    return logits if sampler.grammars is None else sampler.grammars.mask_rows(logits, seqs)


def _sample_with(engine: LLMEngine, probs_fn: ProbsFn) -> None:
    """The instance's sampler draws each seeded row from `probs_fn`'s probabilities."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        logits = masked_first(self, logits, seqs)
        tokens = torch.argmax(logits, dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[row] = race_draw(probs_fn(logits[row], seq.params), seq.generator)
                seq.num_draws += 1
        return tokens

    plant(engine, "sampler.sample", sample)


def sampler_shared_generator(engine: LLMEngine) -> None:
    """Every seeded row of a step draws from the first seeded row's generator (one generator for
    the batch): a token depends on its batch neighbours and on their order."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        logits = masked_first(self, logits, seqs)
        tokens = torch.argmax(logits, dim=-1).tolist()
        shared = next((s.generator for s in seqs if not s.params.greedy), None)
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[row] = sample_token(logits[row], seq.params, shared)
                seq.num_draws += 1
        return tokens

    plant(engine, "sampler.sample", sample)


def generator_reseeded_on_recompute(engine: LLMEngine) -> None:
    """A request preempted by recompute gets a fresh generator from its seed: after it resumes it
    replays draws it has already used. num_draws is left alone — the engine's bookkeeping says
    the offset is unchanged while the generator's state says otherwise."""
    sched = engine.scheduler
    original = sched.preempt

    def preempt(self, seq, plan, mode=None):
        used = original(seq, plan, mode)
        if used == "recompute" and seq.generator is not None:
            fallback = engine.config.seed + seq.seq_id
            seq.generator = make_generator(seq.params, fallback, engine.model.device)
        return used

    bind(sched, "preempt", preempt)


def top_p_before_temperature(engine: LLMEngine) -> None:
    _sample_with(engine, probs_top_p_before_temperature)


def top_k_off_by_one(engine: LLMEngine) -> None:
    _sample_with(engine, probs_top_k_off_by_one)


SAMPLING_MUTANTS = mutant_table(
    "sampling",
    (
        (
            "sampler_shared_generator",
            "all rows of a step draw from one generator",
            sampler_shared_generator,
        ),
        (
            "generator_reseeded_on_recompute",
            "generator re-created from its seed after recompute preemption",
            generator_reseeded_on_recompute,
        ),
        (
            "top_p_before_temperature",
            "top-p applied to the untempered logits",
            top_p_before_temperature,
        ),
        ("top_k_off_by_one", "top-k keeps k + 1 tokens", top_k_off_by_one),
    ),
    suites=("sampling",),
)
