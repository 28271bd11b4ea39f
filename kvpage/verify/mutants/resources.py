"""Resource-path and liveness mutants (R21, R34): release paths that leave blocks or swap space
behind, and the scheduler that never restored a request swapped out mid-prefill."""

from __future__ import annotations

from kvpage.engine.engine import LLMEngine
from kvpage.engine.scheduler import ScheduledSeq, SchedulerOutput
from kvpage.engine.sequence import SeqStatus
from kvpage.verify.mutants.base import Mutant, _bind


def abort_keeps_swap_space(engine: LLMEngine) -> None:
    """Finishing a swapped request (abort, timeout) forgets its KV in the swap space."""
    _bind(engine.swap_space, "discard", lambda self, seq_id: None)


def abort_mid_prefill_leaks_blocks(engine: LLMEngine) -> None:
    """A request removed in the middle of its chunked prefill keeps the blocks it had so far."""
    sched = engine.scheduler
    original = sched.remove

    def remove(self, seq):
        if 0 < seq.num_computed < len(seq.prompt_ids):
            for queue in (self.waiting, self.running, self.swapped):
                if seq in queue:
                    queue.remove(seq)
            return
        original(seq)

    _bind(sched, "remove", remove)


def restore_needs_whole_remainder(engine: LLMEngine) -> None:
    """A swapped request is restored only when its whole remainder fits one step's budget (the
    bug the liveness check found): swapped out mid-prefill, it never comes back and no new
    request is admitted after it."""

    def restore_swapped(self, out, budget):
        for seq in list(self.swapped):
            if seq.hold_until_step > out.step:
                continue
            n = seq.num_uncomputed
            need = self.cache.blocks_for(seq.num_tokens)
            if (
                len(self.running) >= self.config.max_num_seqs
                or n > budget
                or need > self.cache.num_free_blocks()
            ):
                break
            self.swapped.remove(seq)
            self.swapper.swap_in(seq)
            self._note_resume(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, self.cache.append_slots(seq.table, n)))
            budget -= n
        return budget

    _bind(engine.scheduler, "_restore_swapped", restore_swapped)


def held_swap_blocks_admission(engine: LLMEngine) -> None:
    """Any swapped request blocks new admissions, even one held out for many steps."""

    def schedule(self, step):
        out = SchedulerOutput(step)
        self._apply_forced_preemptions(out)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._restore_swapped(out, budget)
            if not self.swapped:
                self._admit_waiting(out, budget)
        self._fail_if_stuck(out)
        self.last_output = out
        return out

    _bind(engine.scheduler, "schedule", schedule)


RESOURCE_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "abort_keeps_swap_space",
        "abort/timeout of a swapped request leaks its swap space",
        "resource",
        abort_keeps_swap_space,
        suites=("resources",),
    ),
    Mutant(
        "abort_mid_prefill_leaks_blocks",
        "abort during a chunked prefill leaks its blocks",
        "resource",
        abort_mid_prefill_leaks_blocks,
        suites=("resources",),
    ),
    Mutant(
        "restore_needs_whole_remainder",
        "a request swapped out mid-prefill is never restored",
        "liveness",
        restore_needs_whole_remainder,
        suites=("resources",),
    ),
    Mutant(
        "held_swap_blocks_admission",
        "a request held in swap blocks every admission",
        "liveness",
        held_swap_blocks_admission,
        suites=("resources",),
    ),
)
