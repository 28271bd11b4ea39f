"""Continuous batching (R9) with chunked prefill and preemption (R11, R20).

Each step: running requests first, oldest first, each gets its pending tokens (1 for decode, a chunk
for prefill) within the token budget; when blocks run out the newest running request is preempted
(recompute: free and re-prefill later, at the front of the queue; swap: KV copied to the CPU).
Then swapped requests are restored, and only then are waiting requests admitted — prefix-cache hits
taken (ref_count raised) before any new allocation, so the allocation cannot evict them.

With preemption switched off nothing can be taken back: admission reserves each request's worst
case, and if running requests still hold every block and none can grow (preemption was switched off
while they ran), the newest of them fails with finish reason "error" so the others can finish.

Prefix sharing inside one step (issue 12). Blocks enter the prefix index only after the step that
wrote their KV (`KVCacheManager.publish_full_blocks`, from the engine's commit), so N requests that
share a system prompt and are admitted in the same step would each compute it. Two ways out:
(a) a request admitted in the same step joins the blocks an earlier request of that step is writing
    in this very forward pass. Correct here only through a property of another module: every layer
    writes all of the step's K/V slots before any sequence attends (model/paged_attention.py). A
    runner that splits a mixed batch into passes (cached-context chunks and decodes before fresh
    prefills, as many do), a kernel that writes each sequence's K/V inside its own attention, or
    asynchronous scheduling turns it into a read before the write. It also breaks the seeds' rule
    as written (R11/R12: a table becomes visible only after its KV is there): the joiner's table
    and the index would name blocks whose KV does not exist yet. And the gate would not guard it:
    on this runner such a join passes every check, and the provenance check sees a step as one
    batch, writes first; only tokens would show the day the runner changes (the mutant
    `same_step_join` is exactly that pair, and the gate catches it as a prefix_key divergence).
(b) the request is held back and admitted in a later step, once the writer's step has published
    the blocks, and takes an ordinary hit. The rule holds literally: nothing is readable, through
    the index or a table, before its KV is written, whatever the runner does. The price: one step
    more to the first token of a held request, and only when it would otherwise recompute a block.
We do (b). Each step, once, the digests of the full blocks that this step's scheduled chunks
complete, and that the commit will publish (chain.keys[num_published : num_tokens // B], caching on
for the namespace, publishing not blocked), form a set, updated as requests are admitted; a waiting
request is deferred when a key it could hit (its first (len - 1) // B: chained digests, so only a
writer of its own namespace matches) is in the set. It is skipped, not a barrier: requests behind
it that share nothing are admitted as usual. Live and bounded: only a chunk scheduled in this very
step makes anyone wait, and a waiter is reached only while budget is left, so every scheduled
prefill completes its prompt in this step and publishes at its end (a preempted, aborted or stalled
writer is not scheduled, so it holds nobody); and a request is deferred at most once per full block
it could hit. A deferred request was not admitted, so its lookup is counted only at its final
admission (`_count_lookup`).

The scheduler holds the cache, the swapper (KV movement) and the observers; never the engine."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvpage.cache.manager import KVCacheManager
from kvpage.config import EngineConfig
from kvpage.engine.events import EngineObserver, Preempted, emit, held_blocks, prefix_hit, who
from kvpage.engine.sequence import SeqStatus, Sequence
from kvpage.engine.swap import KVSwapper


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    slots: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[tuple[Sequence, str]] = field(default_factory=list)  # (seq, mode used)
    # Running but unable to grow with preemption off; and those failed for it (the engine ends them)
    stalled: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # (seq, why)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        cache: KVCacheManager,
        swapper: KVSwapper,
        observers: list[EngineObserver],
    ) -> None:
        self.config = config
        self.cache = cache
        self.swapper = swapper
        self.observers = observers  # the engine's list, shared
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.preemption_enabled = True  # kill switch (R30)
        self.preemptions = {"recompute": 0, "swap": 0}
        # Each prompt once, at its first admission (R29): prefix_hits == sum(num_cached_tokens).
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens served from the cache
        # Prompt tokens fed to the model (re-prefills after recompute preemption count again):
        # without preemption, sum(prompt lengths) - prefix_hits.
        self.prefill_tokens = 0
        self._deferrals: dict[int, int] = {}  # seq id -> steps held back for a pending prefix
        self.last_output: SchedulerOutput | None = None  # what the latest step decided

    # --- queue management ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a request out of whatever queue holds it and give back its blocks."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self._deferrals.pop(seq.seq_id, None)
        self.cache.free_table(seq.table)
        seq.num_computed = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- one step --------------------------------------------------------------------------
    def schedule(self, step: int) -> SchedulerOutput:
        out = SchedulerOutput(step)
        self._apply_forced_preemptions(out)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._restore_swapped(out, budget)
            if not any(s.hold_until_step <= step for s in self.swapped):
                self._admit_waiting(out, budget)
        self._fail_if_stuck(out)
        self.prefill_tokens += sum(_prompt_tokens(item) for item in out.scheduled)
        self.last_output = out
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            room = self._make_room(seq, n, out)
            if room == "self_preempted":
                break  # seq itself was the newest; nothing after it is left
            if room == "no_room":  # preemption switched off: wait for blocks to come back
                out.stalled.append(seq)
                i += 1
                continue
            out.scheduled.append(ScheduledSeq(seq, n, self.cache.append_slots(seq.table, n)))
            budget -= n
            i += 1
        return budget

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> str:
        while not self.cache.can_append(seq.table, n):
            if not self.preemption_enabled:
                return "no_room"
            victim = self.running[-1]
            self.preempt(victim, out)
            if victim is seq:
                return "self_preempted"
        return "ok"

    def _restore_swapped(self, out: SchedulerOutput, budget: int) -> int:
        """Swapped requests come back before any new admission, oldest first. One swapped out
        mid-prefill may have more uncomputed tokens than a whole step's budget: it is restored
        with a chunk of them (like any prefill), never left waiting for a budget it cannot get."""
        for seq in list(self.swapped):
            if seq.hold_until_step > out.step:
                continue
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            n = min(seq.num_uncomputed, budget)
            if self.cache.blocks_for(seq.swapped_tokens + n) > self.cache.num_free_blocks():
                break
            self.swapped.remove(seq)
            self.swapper.swap_in(seq)  # table readable only once the copy is complete
            self._note_resume(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, self.cache.append_slots(seq.table, n)))
            budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        pending = self._pending_keys(out) if self.waiting else None
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if seq.hold_until_step > out.step:
                continue
            if pending and self._defer(seq, pending):
                continue  # a chunk of this step computes its prefix: it hits it next step
            if not self.preemption_enabled and not self._fits_worst_case(seq):
                return
            self._acquire_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if not self.cache.can_append(seq.table, n):
                self.cache.free_table(seq.table)  # give the hit blocks back; retry next step
                seq.num_computed = 0
                return
            self._admit(seq)
            out.scheduled.append(ScheduledSeq(seq, n, self.cache.append_slots(seq.table, n)))
            budget -= n
            if pending is not None:
                self._add_pending(pending, seq)

    # --- same-step prefix sharing (see the module docstring) -------------------------------
    def _pending_keys(self, out: SchedulerOutput) -> set[bytes] | None:
        """Digests of the full blocks this step's chunks complete, published when it ends; None
        when prefix caching is off (nothing will be published, nobody waits)."""
        if not self.cache.enable_prefix_caching:
            return None
        pending: set[bytes] = set()
        for item in out.scheduled:
            self._add_pending(pending, item.seq)
        return pending

    def _add_pending(self, pending: set[bytes], seq: Sequence) -> None:
        """What `publish_full_blocks` will publish for seq after this step (its table already
        counts the step's chunk): O(blocks completed), nothing for most decodes."""
        table, chain = seq.table, seq.chain
        if table.publish_blocked or not self.cache.index.is_enabled(chain.namespace_digest):
            return
        end = min(len(chain.keys), table.num_tokens // self.cache.block_size)
        pending.update(key.digest for key in chain.keys[table.num_published : end])

    def _defer(self, seq: Sequence, pending: set[bytes]) -> bool:
        """Hold seq back this step when a block it could hit is being computed in it. Chained
        digests cover the namespace, so only a writer of its own namespace can hold it."""
        chain = seq.chain
        if not self.cache.index.is_enabled(chain.namespace_digest):
            return False
        cap = self.cache.max_hit_blocks(seq.num_tokens)
        if not any(key.digest in pending for key in chain.keys[:cap]):
            return False
        held = self._deferrals.get(seq.seq_id, 0)
        if held >= cap:  # a backstop: each held step should have published one of its blocks
            return False
        self._deferrals[seq.seq_id] = held + 1
        return True

    def _admit(self, seq: Sequence) -> None:
        """The admission is final: count the lookup (first time only) and report the hit."""
        self.waiting.remove(seq)
        self._deferrals.pop(seq.seq_id, None)
        self._note_resume(seq)
        seq.status = SeqStatus.RUNNING
        self._count_lookup(seq)
        if self.observers and seq.num_computed:
            first = not seq.admitted_once
            emit(self.observers, prefix_hit(seq, self.cache, first))
        if not seq.admitted_once:
            seq.num_cached_tokens = seq.num_computed
        seq.admitted_once = True
        self.running.append(seq)

    def _count_lookup(self, seq: Sequence) -> None:
        """prefix_queries / prefix_hits count each request's prompt once, at its first admission:
        a retried admission never gets here, and a re-prefill after recompute preemption is not
        a new query (the tokens it finds again are not new hits)."""
        if seq.admitted_once:
            return
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed

    def _fits_worst_case(self, seq: Sequence) -> bool:
        """Without preemption nothing can be taken back, so admit a request only if it and every
        running request can grow to max_tokens in the blocks that are left."""
        growth = sum(self._worst_case_blocks(s) - len(s.table.block_ids) for s in self.running)
        # A parallel request whose samples together could outgrow the whole pool is admitted
        # once it has the pool to itself, never left waiting for a pool it cannot get.
        need = min(self._worst_case_blocks(seq), self.cache.pool.num_blocks)
        return growth + need <= self.cache.num_free_blocks()

    def _worst_case_blocks(self, seq: Sequence) -> int:
        """Blocks the sequence may come to hold. A parallel request before its fork (one sequence
        until its first token) becomes n sequences: n times as many."""
        blocks = self.cache.blocks_for(len(seq.prompt_ids) + seq.params.max_tokens)
        unforked = seq.params.n > 1 and seq.sample_index == 0 and not seq.output_ids
        return blocks * seq.params.n if unforked else blocks

    def _acquire_prefix(self, seq: Sequence) -> None:
        seq.num_computed = self.cache.acquire_prefix(seq.table, seq.chain, seq.num_tokens)
        self._note_prefix(seq)

    def _note_prefix(self, seq: Sequence) -> None:
        """Tracers see every lookup's result (a retry's too): the tokens the next step skips."""
        for observer in self.observers:
            observer.on_prefix_hit(seq, seq.num_computed)

    def _note_resume(self, seq: Sequence) -> None:
        if seq.resume_pending:
            for observer in self.observers:
                observer.on_resume(seq, seq.resume_pending, seq.kv_restored)
        seq.resume_pending = ""

    def _fail_if_stuck(self, out: SchedulerOutput) -> None:
        """Preemption off, nothing scheduled, and running requests that cannot grow: no step will
        ever free a block, so the newest of them is failed (the engine ends it) and its blocks
        let the others finish. Without this the server loop would spin on empty steps."""
        if not out.stalled or out.scheduled or out.preempted:
            return
        victim = out.stalled[-1]  # running is oldest first
        held = len({b for s in self.running for b in s.table.block_ids})
        out.failed.append(
            (
                victim,
                f"request {victim.sample_id!r} cannot grow: preemption is off and the running "
                f"requests hold every KV block ({held} of {self.cache.pool.num_blocks}); it was "
                f"failed so that the others can finish",
            )
        )

    # --- preemption ------------------------------------------------------------------------
    def preempt(self, seq: Sequence, out: SchedulerOutput, mode: str | None = None) -> str:
        """Take a running request off the pool. Swap falls back to recompute when the swap
        space is full or the copy fails (R21); returns the mode actually used."""
        requested = mode = mode or self.config.preemption_mode
        held = held_blocks(seq, self.cache.pool) if self.observers else None
        self.running.remove(seq)
        seq.num_preemptions += 1
        if mode == "swap" and self.swapper.swap_out(seq):
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
        else:
            mode = "recompute"
            self.cache.free_table(seq.table)
            seq.num_computed = 0
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)
        self.preemptions[mode] += 1
        seq.resume_pending = mode
        out.preempted.append((seq, mode))
        if held is not None:
            emit(self.observers, Preempted(**who(seq), mode=mode, requested_mode=requested, **held))
        return mode

    def _apply_forced_preemptions(self, out: SchedulerOutput) -> None:
        for seq in list(self.running):
            plan = seq.forced
            if plan is None or plan.done or len(seq.output_ids) < plan.after_tokens:
                continue
            plan.done = True
            self.preempt(seq, out, plan.mode)
            seq.hold_until_step = out.step + plan.resume_after_steps


def _prompt_tokens(item: ScheduledSeq) -> int:
    """Prompt positions in the item's chunk: the tokens of it that are prefill."""
    start = item.seq.num_computed
    return max(0, min(len(item.seq.prompt_ids), start + item.num_new_tokens) - start)
