"""Speculative-decoding mutants: the bugs speculating engines have shipped (TGI's slots under
prefix caching, vLLM's caching over draft tokens, mlx-lm's rejected drafts left in the cache),
each planted in ONE engine instance through a declared seam (kvpage.engine.hooks:
scheduler.commit_verified, speculation.verify). The speculative suite
(kvpage.verify.cases.speculative) runs engines that speculate; an engine that does not has no
speculation to break, and gets no bug. The first divergence must be attributed to "speculative"."""

from __future__ import annotations

import torch

from kvpage.engine.engine import LLMEngine
from kvpage.engine.plan import ScheduledSeq
from kvpage.speculative.rejection import (
    SampledDraws,
    Verification,
    one_hot_probs,
    residual_probs,
    target_probs,
    verify_drafts,
)
from kvpage.verify.mutants.base import mutant_table, plant


def published_before_roll_back(engine: LLMEngine) -> None:
    """The verified step publishes its full blocks before the rejected drafts' slots are rolled
    back, and the roll-back then keeps what was published: a block whose last slot holds a
    rejected draft's KV goes into the cache under the key of the token that replaced it, and
    the sequence's own slots shift by one."""

    def commit_verified(self, item: ScheduledSeq, num_kept: int) -> None:
        seq = item.seq
        seq.num_computed += num_kept
        self.cache.publish_full_blocks(seq.table, seq.chain)
        published = seq.table.num_published * self.cache.block_size
        self.cache.roll_back(seq.table, max(seq.num_computed, published))

    plant(engine, "scheduler.commit_verified", commit_verified)


def rejected_kv_left(engine: LLMEngine) -> None:
    """The kept count is right but the rejected drafts' slots are never given back: the next
    token's slot lands past them, and the positions they hold read the rejected drafts' KV."""

    def commit_verified(self, item: ScheduledSeq, num_kept: int) -> None:
        seq = item.seq
        seq.num_computed += num_kept
        self.cache.publish_full_blocks(seq.table, seq.chain)

    plant(engine, "scheduler.commit_verified", commit_verified)


def slots_advanced_by_k(engine: LLMEngine) -> None:
    """The table keeps k of the step's 1 + k slots, whatever was accepted: after a rejection
    before the last draft the slots run ahead of the tokens, after a full acceptance behind."""

    def commit_verified(self, item: ScheduledSeq, num_kept: int) -> None:
        seq = item.seq
        start = seq.num_computed
        seq.num_computed += num_kept
        self.cache.roll_back(seq.table, start + len(item.drafts))
        self.cache.publish_full_blocks(seq.table, seq.chain)

    plant(engine, "scheduler.commit_verified", commit_verified)


def _verify_with(engine: LLMEngine, rule) -> None:
    """Replace the verification of every speculating sequence by `rule(rows, item) ->
    Verification` (only where the engine speculates)."""
    if engine.speculation is None:
        return

    def verify(self, items: list[ScheduledSeq], logits: torch.Tensor) -> list[Verification]:
        out, first = [], 0
        for item in items:
            rows = logits[first : first + item.num_new_tokens]
            first += item.num_new_tokens
            verification = rule(rows, item)
            if not item.seq.params.greedy:
                item.seq.num_draws += 1
            self.count(item.seq, verification)
            out.append(verification)
        return out

    plant(engine, "speculation.verify", verify)


def bonus_after_rejection(engine: LLMEngine) -> None:
    """After a rejected draft the target's token is taken and then the bonus token too, read
    off the row after the rejected draft (a row conditioned on a token that is not there)."""

    def rule(rows: torch.Tensor, item: ScheduledSeq) -> Verification:
        seq = item.seq
        v = verify_drafts(rows, item.drafts, seq.params, seq.generator, item.draft_probs)
        if v.num_accepted == len(item.drafts):  # no rejection: nothing to take after it
            return v
        bonus = int(torch.argmax(rows[v.num_accepted + 1]))
        return Verification(
            [*v.tokens, bonus], v.num_accepted, v.draft_tokens, v.greedy_targets, v.draws
        )

    _verify_with(engine, rule)


def _sampled_rule(accept_fn, final_fn):
    """A sampled verification with its acceptance or its final distribution replaced; greedy
    requests are verified as they should be."""

    def rule(rows: torch.Tensor, item: ScheduledSeq) -> Verification:
        seq = item.seq
        if seq.params.greedy:
            return verify_drafts(rows, item.drafts, seq.params, seq.generator, item.draft_probs)
        drafts, vocab = item.drafts, rows.shape[-1]
        p = target_probs(rows, seq.params)
        q = one_hot_probs(drafts, vocab, p) if item.draft_probs is None else item.draft_probs
        uniforms = torch.rand(len(drafts), generator=seq.generator, device=rows.device)
        race = torch.empty(vocab, device=rows.device).exponential_(generator=seq.generator)
        idx = torch.arange(len(drafts))
        accept = accept_fn(p[idx, drafts], q[idx, drafts].float())
        kept = next((i for i, ok in enumerate((uniforms < accept).tolist()) if not ok), len(drafts))
        final = p[kept] if kept == len(drafts) else final_fn(p[kept], q[kept].float())
        token = int(torch.argmax(final / race))
        draws = SampledDraws(p, q, uniforms, accept, final, race)
        return Verification([*drafts[:kept], token], kept, list(drafts), draws=draws)

    return rule


def acceptance_without_min(engine: LLMEngine) -> None:
    """A draft is kept with "probability" p/q, unclamped: the recorded acceptance exceeds 1
    wherever the target likes the draft more than the proposer did."""
    rule = _sampled_rule(lambda p_x, q_x: p_x / q_x.clamp_min(1e-30), residual_probs)
    _verify_with(engine, rule)


def resample_from_p(engine: LLMEngine) -> None:
    """After a rejection the replacement is drawn from p itself, not from norm(max(0, p - q)):
    the rejected draft can come right back, and the output over-weights what q proposed."""
    rule = _sampled_rule(
        lambda p_x, q_x: (p_x / q_x.clamp_min(1e-30)).clamp(max=1.0), lambda p, q: p
    )
    _verify_with(engine, rule)


SPECULATIVE_MUTANTS = mutant_table(
    "speculative",
    (
        (
            "published_before_roll_back",
            "a block is published with a rejected draft's KV in it (published before the "
            "roll-back)",
            published_before_roll_back,
        ),
        (
            "rejected_kv_left",
            "the rejected drafts' slots are never rolled back: their KV stays readable",
            rejected_kv_left,
        ),
        (
            "slots_advanced_by_k",
            "the table keeps k slots per speculative step instead of the accepted count",
            slots_advanced_by_k,
        ),
        (
            "bonus_after_rejection",
            "the bonus token is taken after a rejection too",
            bonus_after_rejection,
        ),
        (
            "acceptance_without_min",
            "a draft kept with p/q, without min(1, .)",
            acceptance_without_min,
        ),
        (
            "resample_from_p",
            "the token after a rejection drawn from p instead of norm(max(0, p - q))",
            resample_from_p,
        ),
    ),
    suites=("speculative",),
)
