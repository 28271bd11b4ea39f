"""The swap lifecycle: preemption (recompute: free and re-prefill later, at the front of the
queue; swap: KV copied to the CPU swap space), the swap-out and swap-in it plans as block
operations, and what becomes of a preempted request once the executor applied them.

    preempt(seq, plan)               blocks given back; a SwapOut planned, or recompute
    swap_in(seq, plan)               blocks allocated RESTORING; a SwapIn planned
    block_ops_applied(plan, done)    restored tables readable; a failed swap-out recomputed

A swap falls back to recompute when the swap space is full, and when the executor's copy fails
(the blocks are free by then): the request still finishes. With preemption switched off nothing
can be taken back, and `fail_if_stuck` ends the newest request that can never grow."""

from __future__ import annotations

from kvpage.cache.block_ops import SwapIn, SwapOut
from kvpage.cache.manager import KVCacheManager
from kvpage.engine.cache_reports import CacheReports
from kvpage.engine.events import (
    EngineObserver,
    Preempted,
    SwappedIn,
    SwappedOut,
    emit,
    held_blocks,
    who,
)
from kvpage.engine.plan import BlockOpsDone, Preemption, StepPlan
from kvpage.engine.queues import Queues
from kvpage.engine.requests import Requests
from kvpage.engine.sequence import SeqStatus, Sequence
from kvpage.kv.swap_space import SwapSpace


class SwapLifecycle:
    def __init__(
        self,
        default_mode: str,
        cache: KVCacheManager,
        swap_space: SwapSpace,
        requests: Requests,
        queues: Queues,
        reports: CacheReports,
    ) -> None:
        self.default_mode = default_mode
        self.cache = cache
        self.swap_space = swap_space
        self.requests = requests
        self.queues = queues
        self.reports = reports
        self.observers: list[EngineObserver] = reports.observers  # the engine's list, shared
        self.preemptions = {"recompute": 0, "swap": 0}
        self.swap_counts = {"swap_outs": 0, "swap_ins": 0, "swap_failures": 0}

    # --- out -------------------------------------------------------------------------------
    def preempt(self, seq: Sequence, plan: StepPlan, mode: str | None = None) -> str:
        """Take a running request off the pool, now. Swap falls back to recompute when the swap
        space is full (and, once the executor tried, when the copy fails); returns the
        mode planned."""
        requested = mode = self.default_mode if mode is None else mode
        held = held_blocks(seq, self.cache.pool) if self.observers else None
        self.queues.running.remove(seq)
        seq.num_preemptions += 1
        if mode == "swap" and self.swap_space.can_store(seq.table.num_held()):
            self._swap_out(seq, plan)
        else:
            mode = "recompute"
            self.cache.free_table(seq.table)
            self.queues.to_recompute(seq)
        self.reports.drain(plan)
        self.preemptions[mode] += 1
        seq.resume_pending = mode
        plan.preempted.append(Preemption(seq, mode, requested, held))
        return mode

    def _swap_out(self, seq: Sequence, plan: StepPlan) -> None:
        """Plan the copy out and give the blocks back: the executor reads them before anything
        later in the plan can write them."""
        block_ids = self.cache.begin_evict(seq.table)
        self.swap_space.reserve(seq.seq_id, len(block_ids))
        self.reports.drain(plan)
        plan.block_ops.append(SwapOut(seq.seq_id, tuple(block_ids)))
        seq.swapped_tokens = seq.num_computed
        seq.kv_restored = False
        self.cache.free_table(seq.table)
        seq.status = SeqStatus.SWAPPED
        self.queues.swapped.append(seq)

    # --- back in ---------------------------------------------------------------------------
    def swap_in(self, seq: Sequence, plan: StepPlan) -> None:
        """Allocate its blocks RESTORING (unreadable) and plan the copy back; the table becomes
        readable in `block_ops_applied`, once the executor has written the KV."""
        self.queues.swapped.remove(seq)
        ids = self.cache.allocate_restoring(seq.table, seq.swapped_tokens)
        self.reports.drain(plan)
        plan.block_ops.append(SwapIn(seq.seq_id, tuple(ids)))
        seq.num_computed = seq.swapped_tokens
        seq.status = SeqStatus.RUNNING
        self.queues.running.append(seq)
        plan.resumed.append(seq)
        self.swap_counts["swap_ins"] += 1

    def note_resume(self, seq: Sequence) -> None:
        """A preempted request runs again (admitted, or swapped in): tracers hear how."""
        if seq.resume_pending:
            for observer in self.observers:
                observer.on_resume(seq, seq.resume_pending, seq.kv_restored)
        seq.resume_pending = ""

    # --- once the executor applied the plan's block ops ------------------------------------
    def block_ops_applied(self, plan: StepPlan, done: BlockOpsDone) -> None:
        """Restored tables become readable, and a swap-out whose write failed falls back to
        recompute (its blocks are already free)."""
        for op in plan.ops_of(SwapIn):
            self._finish_swap_in(op, done)
        for pre in plan.preempted:
            if pre.mode == "swap" and pre.seq.seq_id in done.failed_swap_outs:
                self._swap_failed(pre)
            elif pre.mode == "swap":
                self._swap_done(pre)
            if pre.held is not None:
                fields = dict(mode=pre.mode, requested_mode=pre.requested_mode, **pre.held)
                emit(self.observers, Preempted(**who(pre.seq), **fields))

    def _finish_swap_in(self, op: SwapIn, done: BlockOpsDone) -> None:
        seq = self.requests.by_seq_id[op.seq_id]
        self.cache.finish_restore(seq.table)  # only now may a step read these blocks
        latency = done.restored.get(seq.seq_id)
        if latency is not None:
            seq.kv_restored = True
            for observer in self.observers:
                observer.on_kv_restored(seq, list(op.block_ids))
            if self.observers:
                pool = self.cache.pool
                fields = dict(
                    num_tokens=seq.swapped_tokens,
                    blocks=op.block_ids,
                    generations=tuple(pool.blocks[b].generation for b in op.block_ids),
                    latency_s=latency,
                )
                emit(self.observers, SwappedIn(**who(seq), **fields))
        self.note_resume(seq)

    def _swap_done(self, pre: Preemption) -> None:
        self.swap_counts["swap_outs"] += 1
        if pre.held is not None:
            fields = dict(num_tokens=pre.seq.swapped_tokens, **pre.held)
            emit(self.observers, SwappedOut(**who(pre.seq), **fields))

    def _swap_failed(self, pre: Preemption) -> None:
        """The swap-out copy failed: the request is recomputed instead, so it still finishes."""
        seq = pre.seq
        self.swap_counts["swap_failures"] += 1
        self.preemptions["swap"] -= 1
        self.preemptions["recompute"] += 1
        pre.mode = seq.resume_pending = "recompute"
        seq.kv_restored = True
        if seq.seq_id in self.queues.suspended:
            del self.queues.suspended[seq.seq_id]
        else:
            self.queues.swapped.remove(seq)
        self.queues.to_recompute(seq)

    # --- with preemption off ----------------------------------------------------------------
    def fail_if_stuck(self, plan: StepPlan) -> None:
        """Preemption off, nothing scheduled, and running requests that cannot grow: no step will
        ever free a block, so the newest of them is failed (the engine ends it) and its blocks
        let the others finish. Without this the server loop would spin on empty steps."""
        if not plan.stalled or plan.scheduled or plan.preempted:
            return
        victim = plan.stalled[-1]  # running is oldest first
        held = len({b for s in self.queues.running for b in s.table.held_ids()})
        plan.failed.append(
            (
                victim,
                f"request {victim.sample_id!r} cannot grow: preemption is off and the running "
                f"requests hold every KV block ({held} of {self.cache.pool.num_blocks}); it was "
                f"failed so that the others can finish",
            )
        )
