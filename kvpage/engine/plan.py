"""One engine step as plain data (a leaf module: data types only).

    Scheduler.schedule(step) -> StepPlan            who runs, how many tokens, which block ops
    Executor.apply_block_ops(plan.block_ops)        copies, swap-outs, swap-ins, invalidations
    Scheduler.block_ops_applied(plan, done)         restored tables readable; failed swaps recomputed
    Executor.build(plan) -> StepBatch               token ids, positions, cu_seqlens, snapshots
    Executor.run(batch) -> StepLogits               the model, once over the packed batch
    Sampler.draw(...) -> Sampled                    one draw per sampling row, forks first
    Scheduler.update(plan, sampled) -> outputs      tokens appended, stop rule applied

Nothing here calls anything: a tracer, a test or a mutant can read, build or rewrite a plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from kvpage.cache.block_ops import BlockOp

if TYPE_CHECKING:
    import torch

    from kvpage.cache.block_table import TableSnapshot
    from kvpage.engine.sequence import Sequence
    from kvpage.speculative.rejection import Verification

Op = TypeVar("Op", bound=BlockOp)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    slots: list[int]  # KV slot of each new token (block_id * block_size + offset)
    # A speculating sequence (kvpage.engine.speculation): its pending token then these drafts,
    # num_new_tokens = 1 + len(drafts), each of the 1 + k rows scored by the target.
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # (k, V) q of a draft model's sampled drafts


@dataclass(slots=True)
class Preemption:
    seq: Sequence
    mode: str  # what was done: "recompute" or "swap" (a failed swap-out becomes recompute)
    requested_mode: str
    held: dict | None  # the blocks and generations it gave back (when observed)


@dataclass(slots=True)
class StepPlan:
    step: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    # Running but unable to grow with preemption off; and those failed for it (the engine ends them)
    stalled: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # (seq, why)
    resumed: list[Sequence] = field(default_factory=list)  # swapped in this step
    block_ops: list[BlockOp] = field(default_factory=list)  # in the order they must be applied

    def ops_of(self, kind: type[Op]) -> list[Op]:
        """The block ops of one kind (CopyBlock, SwapOut, SwapIn, InvalidateBlock), in order."""
        return [op for op in self.block_ops if isinstance(op, kind)]


@dataclass(slots=True)
class BlockOpsDone:
    """What the executor did of a plan's block ops: swap-outs whose write failed (the request
    falls back to recompute) and swap-ins whose KV is back, with how long each took."""

    failed_swap_outs: set[int] = field(default_factory=set)  # seq ids
    restored: dict[int, float] = field(default_factory=dict)  # seq id -> seconds


@dataclass(slots=True)
class PromptRows:
    """Rows of a step's batch whose logits give prompt logprobs: rows first_row.. at positions
    first_position.., each scoring the prompt token after it."""

    seq: Sequence
    first_row: int
    first_position: int
    count: int


@dataclass(slots=True)
class StepBatch:
    """The model's input for one step: what a tracer observes and what the runner consumes."""

    scheduled: list[ScheduledSeq]
    input_ids: list[int]
    positions: list[int]
    cu_seqlens_q: list[int]
    snapshots: list[TableSnapshot]
    sample_rows: list[int]  # last row of each sequence whose pending tokens are all computed
    sample_seqs: list[ScheduledSeq]
    context_lens: list[int]  # per scheduled sequence: tokens its attention reads, chunk included
    # Only for requests that asked for prompt logprobs (empty otherwise: no extra logits).
    prompt_rows: list[PromptRows] = field(default_factory=list)
    # Speculating sequences (not in sample_seqs) and the first of each one's 1 + k rows.
    spec_seqs: list[ScheduledSeq] = field(default_factory=list)
    spec_rows: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepLogits:
    """What the executor returns for one StepBatch (the batch itself is left as it was given)."""

    logits: torch.Tensor  # (len(sample_rows), V) float32, one row per sampling row
    # (sum of counts, V) float32, one row per prompt row in prompt_rows' order (None: none asked)
    prompt_logits: torch.Tensor | None = None
    # (sum of 1 + k, V) float32: every speculating sequence's rows in spec_seqs' order (or None)
    spec_logits: torch.Tensor | None = None


@dataclass(slots=True)
class Draw:
    """One sampled token and, when the request asked for them, its logprobs."""

    seq: Sequence
    token: int
    row: int  # the logits row it was drawn from
    parent: Sequence | None = None  # for a forked sample's first draw: the sample it forked off
    top_logprobs: dict[int, float] | None = None
    logprob: float | None = None


@dataclass(slots=True)
class Sampled:
    """A step's draws: one per sampling row, and the first draw of each sample forked from a
    row (parallel sampling): those come first, since the fork precedes the parent's append."""

    draws: list[Draw]
    forked: list[Draw] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (M, V) float32, one row per sampling row
    # Speculating sequences: each one's verified tokens (kvpage.engine.speculation)
    verified: list[Verified] = field(default_factory=list)


@dataclass(slots=True)
class Verified:
    """One speculating sequence's verification: its tokens in order (kept drafts, then the
    target's own token) as draws whose `row` indexes StepLogits.spec_logits, and the rule's
    record of how it decided (what an oracle re-checks)."""

    item: ScheduledSeq
    draws: list[Draw]
    verification: Verification
    appended: int = 0  # of the draws, those appended (the stop rule may end it before the last)
