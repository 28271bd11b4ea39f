"""Resource-path and liveness mutants: release paths that leave blocks or swap space
behind, and the scheduler that never restored a request swapped out mid-prefill."""

from __future__ import annotations

from kvpage.engine.engine import LLMEngine
from kvpage.engine.sequence import SeqStatus
from kvpage.verify.mutants.base import bind, mutant_table, plant


def abort_keeps_swap_space(engine: LLMEngine) -> None:
    """Finishing a swapped request (abort, timeout) forgets its KV in the swap space."""
    bind(engine.swap_space, "discard", lambda self, seq_id: None)


def abort_mid_prefill_leaks_blocks(engine: LLMEngine) -> None:
    """A request removed in the middle of its chunked prefill keeps the blocks it had so far."""
    sched = engine.scheduler
    original = sched.remove

    def remove(self, seq):
        if 0 < seq.num_computed < len(seq.prompt_ids):
            for queue in (self.waiting, self.running, self.swapped):
                if seq in queue:
                    queue.remove(seq)
            self.suspended.pop(seq.seq_id, None)
            return
        original(seq)

    bind(sched, "remove", remove)


def restore_needs_whole_remainder(engine: LLMEngine) -> None:
    """A swapped request is restored only when its whole remainder fits one step's budget (the
    bug the liveness check found): swapped out mid-prefill, it never comes back and no new
    request is admitted after it."""

    def restore_chunk(self, seq, budget):
        return seq.num_uncomputed if seq.num_uncomputed <= budget else None

    plant(engine, "scheduler.restore_chunk", restore_chunk)


def held_swap_blocks_admission(engine: LLMEngine) -> None:
    """A request held out in swap (suspended) still blocks new admissions, as if it were
    waiting its turn to come back."""

    def may_admit(self, plan):
        held = any(s.status is SeqStatus.SWAPPED for s in self.suspended.values())
        return not self.swapped and not held

    plant(engine, "scheduler.may_admit", may_admit)


RESOURCE_MUTANTS = mutant_table(
    "resource",
    (
        (
            "abort_keeps_swap_space",
            "abort/timeout of a swapped request leaks its swap space",
            abort_keeps_swap_space,
        ),
        (
            "abort_mid_prefill_leaks_blocks",
            "abort during a chunked prefill leaks its blocks",
            abort_mid_prefill_leaks_blocks,
        ),
    ),
    suites=("resources",),
) + mutant_table(
    "liveness",
    (
        (
            "restore_needs_whole_remainder",
            "a request swapped out mid-prefill is never restored",
            restore_needs_whole_remainder,
        ),
        (
            "held_swap_blocks_admission",
            "a request held in swap blocks every admission",
            held_swap_blocks_admission,
        ),
    ),
    suites=("resources",),
)
