"""Structured-output mutants: the bugs serving engines have shipped in constrained decoding, each
planted in ONE engine instance through a declared seam (kvpage.engine.hooks). The reference
applies every constraint through its own matcher (kvpage.reference.grammar), so the diff sees
the engine's tokens or ends leave it; the first divergence must be attributed to "structured".

The structured suite (kvpage.verify.cases.structured) exercises each: several constrained rows
of different grammars in one batch (a mask on the wrong row), constrained requests preempted by
recompute (a matcher not replayed), n > 1 with a constraint (forks sharing one matcher), seeded
constrained rows with a small top_k (the mask after top-k), grammars that complete before
max_tokens (termination ignored) and two schemas with one title (a cache keyed by name)."""

from __future__ import annotations

import torch

from kvpage.engine.engine import LLMEngine
from kvpage.engine.sequence import Sequence
from kvpage.sampling import filtered_probs, sample_token
from kvpage.structured import TokenMasks
from kvpage.verify.mutants.base import mutant_table, plant
from kvpage.verify.mutants.sampling import race_draw


def mask_of_neighbouring_row(engine: LLMEngine) -> None:
    """The step's masks are filled for the constrained rows in order, but mask k lands on the
    next constrained row's logits (an index into the compacted bitmask taken as a batch row)."""
    masks = TokenMasks(engine.grammars.vocab_size)

    def mask_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return logits
        matchers = [seqs[i].grammar for i in rows]
        return masks.apply(logits, rows, matchers[-1:] + matchers[:-1])

    plant(engine, "grammars.mask_rows", mask_rows)


def matcher_not_replayed(engine: LLMEngine) -> None:
    """A request preempted by recompute gets its matcher back at the grammar's start: its
    output is not replayed into it, so the next mask is the first token's."""

    def replay(self, seq: Sequence) -> None:
        if seq.grammar is not None:
            seq.grammar.replay([])

    plant(engine, "grammars.replay", replay)


def forks_share_one_matcher(engine: LLMEngine) -> None:
    """A parallel sample gets its parent's matcher itself, not a copy: every sample's token
    advances the one matcher."""

    def fork(self, matcher):
        return matcher

    plant(engine, "grammars.fork", fork)


def mask_after_top_k(engine: LLMEngine) -> None:
    """A constrained sampled row is cut by top-k / top-p on its unmasked logits and masked
    after: the grammar's ids outside the model's top k can never be drawn (and a step whose
    top k the grammar refuses altogether draws from nothing)."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        masked = self.grammars.mask_rows(logits, seqs)
        tokens = torch.max(masked, dim=-1).indices.tolist()
        for row, seq in enumerate(seqs):
            if seq.params.greedy:
                continue
            if seq.grammar is None:
                tokens[row] = sample_token(logits[row], seq.params, seq.generator)
            else:
                params = seq.params
                raw = logits[row].float()
                scaled = (raw - raw.max()) / params.temperature
                probs = filtered_probs(scaled, params.top_k, params.top_p)
                probs = probs.masked_fill(torch.isinf(masked[row]), 0.0)
                tokens[row] = race_draw(probs, seq.generator)
            seq.num_draws += 1
        return tokens

    plant(engine, "sampler.sample", sample)


def grammar_termination_ignored(engine: LLMEngine) -> None:
    """The stop rule never asks the grammar: a complete structured output runs on (to EOS or
    max_tokens) instead of ending with "stop"."""

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_ids:
            return "stop"
        return "length" if len(seq.output_ids) >= seq.params.max_tokens else None

    plant(engine, "scheduler.stop_reason", stop_reason)


def grammar_cache_keyed_by_name(engine: LLMEngine) -> None:
    """Compiled grammars are cached by the schema's name (its title), or by the constraint's
    kind when it has none: a second schema with the same title gets the first one's grammar."""

    def cache_key(self, params) -> str:
        return params.schema_name or params.kind

    plant(engine, "grammar_compiler.cache_key", cache_key)


STRUCTURED_MUTANTS = mutant_table(
    "structured",
    (
        (
            "mask_of_neighbouring_row",
            "each constrained row masked by the next constrained row's grammar",
            mask_of_neighbouring_row,
        ),
        (
            "matcher_not_replayed_after_recompute",
            "the matcher restarts at the grammar's start after a recompute preemption",
            matcher_not_replayed,
        ),
        (
            "forks_share_one_matcher",
            "parallel samples share their parent's matcher",
            forks_share_one_matcher,
        ),
        ("mask_after_top_k", "top-k applied before the grammar mask", mask_after_top_k),
        (
            "grammar_termination_ignored",
            "a complete grammar does not end the request",
            grammar_termination_ignored,
        ),
        (
            "grammar_cache_keyed_by_name",
            "compiled grammars cached by schema name instead of content",
            grammar_cache_keyed_by_name,
        ),
    ),
    suites=("structured",),
    needs_tokenizer=True,
)
