"""The scheduler owns the request lifecycle: continuous batching with chunked prefill and
preemption, and what becomes of each request after its tokens are drawn.

`schedule(step)` returns the step as data (kvpage.engine.plan.StepPlan): running requests first,
oldest first, each with its pending tokens (1 for decode, a chunk for prefill) within the token
budget; when blocks run out the newest running request is preempted (kvpage.engine.swapping).
Then swapped requests are restored, and only then are waiting requests admitted — prefix-cache
hits taken (ref_count raised) before any new allocation, so the allocation cannot evict them. Every
KV movement those decisions imply is a block operation in the plan, in order; the scheduler itself
touches no tensor. After the forward pass, `commit` counts the KV written and publishes the newly
full blocks; `update(plan, sampled)` appends the draws, applies the stop rule and returns outputs.
With preemption switched off, admission reserves each request's worst case.

A request admitted in the same step as another that is computing the prefix it could hit is held
back one step (kvpage.engine.prefix_wait explains why), then takes an ordinary hit. Events
(kvpage.engine.events) reach the observers at the moment the thing happens."""

from __future__ import annotations

import time

from kvpage.cache.manager import KVCacheManager
from kvpage.config import EngineConfig
from kvpage.engine.adapters import AdapterHolds
from kvpage.engine.cache_reports import CacheReports
from kvpage.engine.events import (
    EngineObserver,
    abort_event,
    emit,
    end_events,
    held_blocks,
    prefix_hit,
)
from kvpage.engine.output_buffer import OutputBuffer
from kvpage.engine.outputs import Decode, RequestOutput
from kvpage.engine.plan import BlockOpsDone, Draw, Sampled, ScheduledSeq, StepPlan
from kvpage.engine.prefix_wait import PrefixWait
from kvpage.engine.prompt_row_store import PromptRowStore
from kvpage.engine.queues import Queues
from kvpage.engine.requests import Requests
from kvpage.engine.sequence import SeqStatus, Sequence
from kvpage.engine.speculation import Speculation
from kvpage.engine.swapping import SwapLifecycle
from kvpage.kv.swap_space import SwapSpace
from kvpage.lora.slots import LoraSlots


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        cache: KVCacheManager,
        swap_space: SwapSpace,
        requests: Requests,
        observers: list[EngineObserver],
        decode: Decode = None,
        lora_slots: LoraSlots | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.swap_space = swap_space
        self.requests = requests
        self.observers = observers  # the engine's list, shared
        self.outputs = OutputBuffer(requests, decode)
        self.queues = Queues()
        q = self.queues  # its own objects, never rebound (kvpage.engine.queues says what each is)
        self.waiting, self.running, self.swapped = q.waiting, q.running, q.swapped
        self.suspended = q.suspended
        self.reports = CacheReports(cache, requests, observers)
        self.swaps = SwapLifecycle(
            config.preemption_mode, cache, swap_space, requests, self.queues, self.reports
        )
        self.preemptions, self.swap_counts = self.swaps.preemptions, self.swaps.swap_counts
        self.to_fork: set[int] = set()  # seq ids of n > 1 requests before their first token
        self.preemption_enabled = True  # kill switch
        self.counters = {"aborts": 0, "timeouts": 0}
        # Each prompt once, at its first admission: prefix_hits == sum(num_cached_tokens).
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens served from the cache
        # Prompt tokens fed to the model (re-prefills after recompute preemption count again):
        # without preemption, sum(prompt lengths) - prefix_hits.
        self.prefill_tokens = 0
        self.prefix_wait = PrefixWait(cache)
        self.prompt_rows = PromptRowStore(cache)
        self.lora_slots = lora_slots  # the engine's, when it serves adapters
        self.adapters = AdapterHolds(lora_slots)
        self.speculation = speculation  # the engine's, when it decodes speculatively

    # --- queues -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.params.n > 1:
            self.to_fork.add(seq.seq_id)  # prefilled once, as one sequence, then forked

    def remove(self, seq: Sequence) -> None:
        """Take a request out of whatever queue holds it and give back its blocks and its
        swap space."""
        self.queues.take_out(seq)
        self.prefix_wait.forget(seq)
        self.cache.free_table(seq.table)
        seq.num_computed = 0
        self.swap_space.discard(seq.seq_id)

    def has_work(self) -> bool:
        return self.queues.has_work()

    # --- one step --------------------------------------------------------------------------
    def schedule(self, step: int) -> StepPlan:
        plan = StepPlan(step)
        self.reports.drain(plan)  # ops recorded between steps (frees of finished requests)
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        if not plan.preempted:
            budget = self._restore_swapped(plan, budget)
            if self.may_admit(plan):
                self._admit_waiting(plan, budget)
        self.swaps.fail_if_stuck(plan)
        self.prefill_tokens += sum(_prompt_tokens(item) for item in plan.scheduled)
        self.reports.drain(plan)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        spec = self.speculation
        proposals = spec.propose(self.running, self.to_fork) if spec and self.running else None
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            proposal = proposals.get(seq.seq_id) if proposals else None
            if proposal is not None:
                n = self._speculated(seq, proposal.tokens, budget)
                if n == 1:
                    proposal = None
            room = self._make_room(seq, n, plan)
            if room == "self_preempted":
                break  # seq itself was the newest; nothing after it is left
            if room == "no_room":  # preemption switched off: wait for blocks to come back
                plan.stalled.append(seq)
                i += 1
                continue
            item = ScheduledSeq(seq, n, self._append(seq, n, plan))
            if proposal is not None:
                item.drafts, item.draft_probs = proposal.tokens, proposal.probs
            plan.scheduled.append(item)
            budget -= n
            i += 1
        return budget

    def _speculated(self, seq: Sequence, drafts: list[int], budget: int) -> int:
        """Tokens `seq` runs with its drafts: 1 + k, or 1 when the step's budget or the pool
        cannot take them without preempting anyone (drafts never cost another request its KV)."""
        n = 1 + len(drafts)
        return n if n <= budget and self.cache.can_append(seq.table, n) else 1

    def _make_room(self, seq: Sequence, n: int, plan: StepPlan) -> str:
        while not self.cache.can_append(seq.table, n):
            if not self.preemption_enabled:
                return "no_room"
            victim = self.choose_victim(seq)
            self.preempt(victim, plan)
            if victim is seq:
                return "self_preempted"
        return "ok"

    def choose_victim(self, needs_room: Sequence) -> Sequence:
        """Which running request is preempted when `needs_room` cannot grow (a declared seam,
        kvpage.engine.hooks): the newest, so the oldest requests keep making progress. Running
        is oldest first, so the newest never precedes `needs_room` in this step's order."""
        return self.running[-1]

    def _append(self, seq: Sequence, n: int, plan: StepPlan) -> list[int]:
        slots = self.cache.append_slots(seq.table, n)
        self.reports.drain(plan)
        return slots

    def _restore_swapped(self, plan: StepPlan, budget: int) -> int:
        """Swapped requests come back before any new admission, oldest first."""
        running = sum(s.fan_out for s in self.running)  # an unforked n-request counts n
        for seq in list(self.swapped):
            if budget <= 0 or running + seq.fan_out > self.config.max_num_seqs:
                break
            n = self.restore_chunk(seq, budget)
            if n is None or self.cache.restore_need(seq.swapped_tokens, n) > (
                self.cache.num_free_blocks()
            ):
                break
            self.swaps.swap_in(seq, plan)
            running += seq.fan_out
            plan.scheduled.append(ScheduledSeq(seq, n, self._append(seq, n, plan)))
            budget -= n
        return budget

    def restore_chunk(self, seq: Sequence, budget: int) -> int | None:
        """Tokens a swapped request is restored with this step, or None for not now (a declared
        seam). One swapped out mid-prefill may have more uncomputed tokens than a whole step's
        budget: it comes back with a chunk of them (like any prefill), never left waiting for a
        budget it cannot get."""
        return min(seq.num_uncomputed, budget)

    def may_admit(self, plan: StepPlan) -> bool:
        """Whether waiting requests may be admitted in this step (a declared seam): not while a
        swapped request is still out (it came first; new admissions would take its blocks)."""
        return not self.swapped

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        pending = self.prefix_wait.pending_keys(plan.scheduled) if self.waiting else None
        running = sum(s.fan_out for s in self.running)  # an unforked n-request counts n
        for seq in list(self.waiting):
            if budget <= 0 or running + seq.fan_out > self.config.max_num_seqs:
                return
            if pending and self.prefix_wait.defer(seq, pending):
                continue  # a chunk of this step computes its prefix: it hits it next step
            if not self.preemption_enabled and not self.fits_worst_case(seq):
                return
            if not self.adapters.fits(seq):
                # Every adapter slot is held: it waits for one, and the requests behind it
                # that need no new slot (the base model, an adapter already resident) go ahead.
                # Stopping here would stall the whole queue behind a slot that only a holder
                # outside this step (running, preempted, suspended) can give back.
                continue
            self.acquire_prefix(seq)
            self.reports.corruptions()
            n = min(seq.num_uncomputed, budget)
            if not self.cache.can_append(seq.table, n):
                self.cache.free_table(seq.table)  # give the hit blocks back; retry next step
                seq.num_computed = 0
                return
            self._admit(seq)
            running += seq.fan_out
            plan.scheduled.append(ScheduledSeq(seq, n, self._append(seq, n, plan)))
            budget -= n
            if pending is not None:
                self.prefix_wait.add(pending, seq)

    def _admit(self, seq: Sequence) -> None:
        """The admission is final: count the lookup (first time only) and report the hit."""
        self.adapters.hold(seq)
        self.waiting.remove(seq)
        self.prefix_wait.forget(seq)
        self.swaps.note_resume(seq)
        seq.status = SeqStatus.RUNNING
        self.count_lookup(seq)
        if self.observers and seq.num_computed:
            first = not seq.admitted_once
            emit(self.observers, prefix_hit(seq, self.cache, first))
        if not seq.admitted_once:
            seq.num_cached_tokens = seq.num_computed
        seq.admitted_once = True
        self.running.append(seq)

    def count_lookup(self, seq: Sequence) -> None:
        """prefix_queries / prefix_hits count each request's prompt once, at its first admission
        (a declared seam): a retried admission never gets here, and a re-prefill after
        recompute preemption is not a new query (the tokens it finds again are not new hits)."""
        if seq.admitted_once:
            return
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed

    def acquire_prefix(self, seq: Sequence) -> None:
        """The admission's prefix lookup (a declared seam): the cached blocks it takes, before
        any allocation. Tracers see every lookup's result (a retry's too)."""
        cap = self.prompt_hit_blocks(seq)
        seq.num_computed = self.cache.acquire_prefix(seq.table, seq.chain, seq.num_tokens, cap)
        if seq.needs_prompt_rows and seq.num_computed:
            sources = self.prompt_rows.serve(seq, seq.num_computed // self.cache.block_size)
            for observer in self.observers:
                observer.on_prompt_rows(seq, sources)
        self.note_prefix(seq)

    def prompt_hit_blocks(self, seq: Sequence) -> int | None:
        """The most cached blocks the request may take, beyond the cache's own cap (a declared
        seam): while it still needs prompt logprobs, only blocks whose rows are scored already
        or kept in the row store (a hit's positions get no logits to score the prompt with);
        no limit (None) otherwise."""
        if not seq.needs_prompt_rows:
            return None
        return self.prompt_rows.servable_blocks(seq, self.cache.max_hit_blocks(seq.num_tokens))

    def note_prefix(self, seq: Sequence) -> None:
        """Tell tracers the tokens the next step skips for `seq` (its num_computed)."""
        for observer in self.observers:
            observer.on_prefix_hit(seq, seq.num_computed)

    def fits_worst_case(self, seq: Sequence) -> bool:
        """Without preemption nothing can be taken back, so admit a request only if it and every
        running request can grow to max_tokens in the blocks that are left (a declared seam)."""
        growth = sum(self._worst_case_blocks(s) - s.table.num_held() for s in self.running)
        # A parallel request whose samples together could outgrow the whole pool is admitted
        # once it has the pool to itself, never left waiting for a pool it cannot get.
        need = min(self._worst_case_blocks(seq), self.cache.pool.num_blocks)
        return growth + need <= self.cache.num_free_blocks()

    def _worst_case_blocks(self, seq: Sequence) -> int:
        """Blocks the sequence may come to hold. A parallel request before its fork (one sequence
        until its first token) becomes n sequences: n times as many."""
        blocks = self.cache.max_blocks_for(len(seq.prompt_ids) + seq.params.max_tokens)
        return blocks * seq.fan_out

    # --- preemption and swapping (kvpage.engine.swapping) -----------------------------------
    def preempt(self, seq: Sequence, plan: StepPlan, mode: str | None = None) -> str:
        """Take a running request off the pool, now; returns the mode planned (swap falls back
        to recompute when the swap space is full)."""
        return self.swaps.preempt(seq, plan, mode)

    def block_ops_applied(self, plan: StepPlan, done: BlockOpsDone) -> None:
        """The executor applied the plan's block ops: restored tables become readable, and a
        swap-out whose write failed falls back to recompute."""
        self.swaps.block_ops_applied(plan, done)

    # --- after the forward pass ------------------------------------------------------------
    def commit(self, plan: StepPlan) -> None:
        """The step wrote its KV: count it, and publish the blocks it completed (only now may
        another request read them)."""
        for item in plan.scheduled:
            if item.drafts:  # counted once verified (settle), never before
                continue
            seq = item.seq
            seq.num_computed += item.num_new_tokens
            self.cache.publish_full_blocks(seq.table, seq.chain)
            if seq.prompt_logprobs is not None:  # rows of the blocks just published, kept
                seq.rows_offered = self.prompt_rows.offer(seq, seq.rows_offered)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of a parallel request whose prefill just completed, made before sample
        0's first token is appended: they share the prompt's KV, not sample 0's output. They
        run right after the parent (same age)."""
        self.to_fork.discard(parent.seq_id)
        children = [self.requests.new_sample(parent, i) for i in range(1, parent.params.n)]
        for child in children:
            self.adapters.hold(child)
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        return children

    def update(self, plan: StepPlan, sampled: Sampled) -> list[RequestOutput]:
        """Append the step's draws (forked samples first) and every speculating sequence's
        verified tokens, end what the stop rule ends, and return the outputs since the last
        step."""
        for draw in (*sampled.forked, *sampled.draws):
            self._append_draw(draw)
        for verified in sampled.verified:
            verified.appended = self.settle(verified.item, verified.draws)
        return self.take_outputs()

    def settle(self, item: ScheduledSeq, draws: list[Draw]) -> int:
        """A speculating sequence's verified tokens, appended in order until the stop rule
        ends it. Its KV is computed for the pending token and the kept drafts only: the slots
        past them are rolled back, and only then are its full blocks published. Returns how
        many draws were appended."""
        seq = item.seq
        for i, draw in enumerate(draws):
            self._append_draw(draw)
            if seq.finished:
                return i + 1
        self.commit_verified(item, len(draws))
        return len(draws)

    def commit_verified(self, item: ScheduledSeq, num_kept: int) -> None:
        """The verified KV of a speculating sequence (a declared seam): of the 1 + k slots its
        step wrote, the first `num_kept` (its pending token and the kept drafts) are computed;
        the rejected drafts' slots are given back, and only then are the blocks full of
        verified tokens published."""
        seq = item.seq
        seq.num_computed += num_kept
        self.cache.roll_back(seq.table, seq.num_computed)
        self.cache.publish_full_blocks(seq.table, seq.chain)

    def _append_draw(self, draw: Draw) -> None:
        seq, token = draw.seq, draw.token
        if seq.params.max_tokens == 0:  # the prompt only scored: its rows are the output
            self.finish(seq, "length")
            return
        if seq.grammar is not None and not seq.grammar.advance(token):
            self.fail(seq, f"token {token} is outside the grammar: {seq.grammar.error}")
            return
        seq.output_ids.append(token)
        seq.chain.extend((token,))
        if seq.logprobs is not None:
            seq.logprobs.append(draw.top_logprobs)
            seq.token_logprobs.append(draw.logprob)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        reason = self.stop_reason(seq, token)
        if reason is not None:
            self.finish(seq, reason)
        elif self.outputs.emit_progress:
            self.outputs.progress(seq, [token])

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        """The stop rule after `token` was appended (a declared seam): a stop id (EOS unless
        ignore_eos, or one of stop_token_ids) ends with "stop", max_tokens with "length"; a stop
        drawn exactly at max_tokens is a stop. A structured output ends with "stop" once its
        grammar is complete (nothing may follow)."""
        if token in seq.stop_ids:
            return "stop"
        if seq.grammar is not None and seq.grammar.finished:
            return "stop"
        if len(seq.output_ids) >= seq.params.max_tokens:
            return "length"
        return None

    def take_outputs(self) -> list[RequestOutput]:
        return self.outputs.take()

    # --- the end of a request --------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        held = held_blocks(seq, self.cache.pool) if self.observers else None
        self.remove(seq)
        self.adapters.release(seq)
        if self.speculation is not None:
            self.speculation.forget(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if held is not None:
            for event in end_events(seq, reason, held):
                emit(self.observers, event)
        self.to_fork.discard(seq.seq_id)  # a parallel request may end before its fork
        self.outputs.finished(seq, seq.output_ids[-1:] if reason in ("stop", "length") else [])

    def fail(self, seq: Sequence, message: str) -> None:
        """End a sample with finish reason "error"; `message` reaches RequestOutput.error."""
        seq.error = message
        self.finish(seq, "error")

    def abort(self, name: str, reason: str = "abort") -> bool:
        """Abort wherever the request is (waiting, running, swapped, suspended); its blocks come
        back. A request id ends every unfinished sample; `rid#i` only that sample (the server's
        stop strings end samples one at a time)."""
        live = [seq for seq in self.requests.named(name) if not seq.finished]
        if not live:
            return False
        self.counters["aborts" if reason == "abort" else "timeouts"] += 1
        if self.observers:
            emit(self.observers, abort_event(name, live, reason))
        for seq in live:
            self.finish(seq, reason)
        return True

    def expire_timeouts(self) -> None:
        """Only requests that have a deadline are looked at: none, no per-step scan."""
        now = time.monotonic()
        heads = self.requests.heads
        for request_id in [r for r in self.requests.with_deadline if now > heads[r].deadline]:
            self.abort(request_id, reason="timeout")


def _prompt_tokens(item: ScheduledSeq) -> int:
    """Prompt positions in the item's chunk: the tokens of it that are prefill."""
    start = item.seq.num_computed
    return max(0, min(len(item.seq.prompt_ids), start + item.num_new_tokens) - start)
