"""Cache-policy mutants: eviction that forgets reuse, a digest confirmed at
the root only, prefix hits counted again when a request is re-admitted, and same-step prefix
sharing that joins blocks before they are written."""

from __future__ import annotations

import torch

from kvpage.cache.block_pool import BlockState
from kvpage.engine.engine import LLMEngine
from kvpage.engine.plan import StepBatch, StepLogits
from kvpage.verify.mutants.base import Mutant, bind, plant
from kvpage.verify.mutants.cache import fast_key_entry, naive_match


def fifo_eviction(engine: LLMEngine) -> None:
    """Evicts the CACHED leaf published first, however recently it was reused."""

    def choose_victim(self):
        for bid, entry in self.by_block.items():  # dict order = publish order
            if self.pool.blocks[bid].state is BlockState.CACHED and entry.num_children == 0:
                return bid
        raise RuntimeError("no evictable cached block")

    plant(engine, "index.choose_victim", choose_victim)


def digest_confirmed_at_root_only(engine: LLMEngine) -> None:
    """The full digest is compared for the first block only; deeper hits trust the fast key."""
    original = engine.cache.index.confirmed

    def confirmed(self, key, namespace, depth):
        if depth == 0:
            return original(key, namespace, depth)
        return fast_key_entry(self, key)

    plant(engine, "index.confirmed", confirmed)
    plant(engine, "index.match", naive_match)


def hits_recounted_on_readmission(engine: LLMEngine) -> None:
    """A re-admitted request (re-prefill after recompute) counts its prefix lookup and hits
    again: every final admission is counted, not the first only."""

    def count_lookup(self, seq):
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed

    plant(engine, "scheduler.count_lookup", count_lookup)


def same_step_join(engine: LLMEngine) -> None:
    """Option (a) of kvpage.engine.prefix_wait without its precondition. Blocks are published when
    they are allocated, so a request admitted later in the same step joins the writer's blocks
    instead of waiting for them; and the step runs the chunks that read cached context before
    the fresh prefills that only write it (a mixed batch split into passes, as many runners do).
    The joiner reads the writer's blocks before the writer's pass has written them."""
    cache, scheduler, runner = engine.cache, engine.scheduler, engine.runner
    append_slots, run = cache.append_slots, runner.run

    def publish_on_allocation(self, table, num_new_tokens):
        slots = append_slots(table, num_new_tokens)
        seq = next((s for s in scheduler.running if s.table is table), None)
        if seq is not None:
            self.publish_full_blocks(table, seq.chain)
        return slots

    def readers_first(self, batch):
        reads = [i for i, item in enumerate(batch.scheduled) if item.seq.num_computed]
        writes = [i for i in range(len(batch.scheduled)) if i not in reads]
        if not reads or not writes:
            return run(batch)
        rows = {}
        for part in (reads, writes):
            sub = _sub_batch(batch, part)
            if sub.sample_seqs:
                for item, row in zip(sub.sample_seqs, run(sub).logits, strict=True):
                    rows[id(item)] = row
        return StepLogits(torch.stack([rows[id(item)] for item in batch.sample_seqs]))

    bind(cache, "append_slots", publish_on_allocation)
    bind(runner, "run", readers_first)


def _sub_batch(batch: StepBatch, indices: list[int]) -> StepBatch:
    """The part of a step's batch made of the scheduled items at `indices`, repacked."""
    sampled = {id(item) for item in batch.sample_seqs}
    out = StepBatch([], [], [], [0], [], [], [], [])
    for i in indices:
        item, start, end = batch.scheduled[i], batch.cu_seqlens_q[i], batch.cu_seqlens_q[i + 1]
        out.scheduled.append(item)
        out.input_ids.extend(batch.input_ids[start:end])
        out.positions.extend(batch.positions[start:end])
        out.cu_seqlens_q.append(out.cu_seqlens_q[-1] + end - start)
        out.snapshots.append(batch.snapshots[i])
        out.context_lens.append(batch.context_lens[i])
        if id(item) in sampled:
            out.sample_rows.append(out.cu_seqlens_q[-1] - 1)
            out.sample_seqs.append(item)
    return out


POLICY_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "fifo_eviction",
        "eviction ignores reuse (FIFO)",
        "prefix_key",
        fifo_eviction,
        suites=("policy",),
    ),
    Mutant(
        "digest_confirmed_at_root_only",
        "digest confirmed for block 0 only (8-bit fast keys)",
        "prefix_key",
        digest_confirmed_at_root_only,
        {"fast_key_bits": 8},
        suites=("policy",),
    ),
    Mutant(
        "hits_recounted_on_readmission",
        "prefix hits counted again on re-admission",
        "accounting",
        hits_recounted_on_readmission,
        suites=("policy",),
    ),
    Mutant(
        "same_step_join",
        "same-step sharing joins blocks before they are written",
        "prefix_key",
        same_step_join,
        suites=("policy",),
    ),
)
