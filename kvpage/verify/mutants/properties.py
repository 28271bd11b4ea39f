"""Mutants of the per-step properties (kvpage.verify.properties): bugs that leave every token
right, so the diff against the reference cannot see them, and break a rule of the step instead —
the token and sequence budget, the independence of unseeded samples, the finish reason at
max_tokens, the reservation with preemption off, the bounded same-step hold-back. Each plants
its bug through a declared seam (kvpage.engine.hooks) or a public method."""

from __future__ import annotations

from dataclasses import replace as with_fields

from kvpage.engine.engine import LLMEngine
from kvpage.engine.sequence import Sequence
from kvpage.sampling import make_generator
from kvpage.verify.mutants.base import Mutant, bind, plant, replace
from kvpage.verify.mutants.stop import grammar_complete


# --- step budget ---------------------------------------------------------------------------
def restore_ignores_budget(engine: LLMEngine) -> None:
    """A swapped request comes back with everything it has left to compute, however little of
    the step's token budget is left (the chunking applied to prefills is forgotten on restore)."""

    def restore_chunk(self, seq, budget):
        return seq.num_uncomputed

    plant(engine, "scheduler.restore_chunk", restore_chunk)


def seq_cap_off_by_one(engine: LLMEngine) -> None:
    """The scheduler checks the sequence cap before counting the one it admits: one sequence more
    than max_num_seqs runs in a step."""
    sched = engine.scheduler
    relaxed = with_fields(sched.config, max_num_seqs=sched.config.max_num_seqs + 1)
    replace(sched, "config", relaxed)


# --- unseeded samples ----------------------------------------------------------------------
def unseeded_engine_seed(engine: LLMEngine) -> None:
    """Every unseeded request and sample is seeded with the engine's seed alone, not one per
    sequence: identical prompts draw identical tokens, and forked samples move in lockstep."""
    requests = engine.requests
    new_sequence, new_sample = requests.new_sequence, requests.new_sample

    def reseed(self, seq: Sequence) -> Sequence:
        if seq.params.seed is None and not seq.params.greedy:
            seq.generator = make_generator(seq.params, self.seed, self.device)
        return seq

    bind(requests, "new_sequence", lambda self, req, ns: reseed(self, new_sequence(req, ns)))
    bind(requests, "new_sample", lambda self, p, i: reseed(self, new_sample(p, i)))


def fork_copies_generator(engine: LLMEngine) -> None:
    """An unseeded parallel request's samples start from a copy of the parent's generator state
    (the fork copies the sequence, generator included): its children draw in lockstep."""
    requests = engine.requests
    new_sample = requests.new_sample

    def copied(self, parent: Sequence, index: int) -> Sequence:
        child = new_sample(parent, index)
        if parent.params.seed is None and parent.generator is not None:
            child.generator.set_state(parent.generator.get_state())
        return child

    bind(requests, "new_sample", copied)


# --- finish precedence ---------------------------------------------------------------------
def length_before_stop(engine: LLMEngine) -> None:
    """The stop rule checks max_tokens first: a stop id drawn as the last allowed token ends the
    request with "length"."""

    def stop_reason(self, seq, token):
        if len(seq.output_ids) >= seq.params.max_tokens:
            return "length"
        return "stop" if token in seq.stop_ids or grammar_complete(seq) else None

    plant(engine, "scheduler.stop_reason", stop_reason)


# --- reservation with preemption off -------------------------------------------------------
def _worst_blocks(sched, seq: Sequence) -> int:
    n = seq.params.n if seq.params.n > 1 and not seq.output_ids else 1
    return sched.cache.blocks_for(len(seq.prompt_ids) + seq.params.max_tokens) * n


def reservation_ignores_running(engine: LLMEngine) -> None:
    """The reservation checks only the new request's worst case against the free pool, not what
    the running requests may still grow into: it over-commits the pool."""

    def fits_worst_case(self, seq):
        need = min(_worst_blocks(self, seq), self.cache.pool.num_blocks)
        return need <= self.cache.num_free_blocks()

    plant(engine, "scheduler.fits_worst_case", fits_worst_case)


def reservation_counts_held_twice(engine: LLMEngine) -> None:
    """The running requests' growth is their whole worst case, the blocks they already hold
    counted again: requests that fit are kept waiting."""

    def fits_worst_case(self, seq):
        growth = sum(_worst_blocks(self, s) for s in self.running)
        need = min(_worst_blocks(self, seq), self.cache.pool.num_blocks)
        return growth + need <= self.cache.num_free_blocks()

    plant(engine, "scheduler.fits_worst_case", fits_worst_case)


# --- bounded hold-back ---------------------------------------------------------------------
def hold_on_published_blocks(engine: LLMEngine) -> None:
    """The set of blocks a step is computing takes every full block of each scheduled request,
    the ones published long ago included: a request sharing a running request's prefix is held
    back step after step (until the backstop lets it in) instead of once."""
    wait = engine.scheduler.prefix_wait
    cache = engine.cache

    def add(self, pending, seq):
        table, chain = seq.table, seq.chain
        if table.publish_blocked or not cache.index.is_enabled(chain.namespace_digest):
            return
        end = min(len(chain.keys), table.num_tokens // cache.block_size)
        pending.update(key.digest for key in chain.keys[:end])

    bind(wait, "add", add)


PROPERTY_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "restore_ignores_budget",
        "a swapped request is restored over the step's token budget",
        "step_budget",
        restore_ignores_budget,
        suites=("resources",),
    ),
    Mutant(
        "seq_cap_off_by_one",
        "one sequence more than max_num_seqs per step",
        "step_budget",
        seq_cap_off_by_one,
        suites=("failure",),
    ),
    Mutant(
        "unseeded_engine_seed",
        "every unseeded request seeded with the engine's seed",
        "sample_independence",
        unseeded_engine_seed,
        suites=("sampling",),
    ),
    Mutant(
        "fork_copies_generator",
        "forked samples copy the parent's generator",
        "sample_independence",
        fork_copies_generator,
        suites=("sampling",),
    ),
    Mutant(
        "length_before_stop",
        "max_tokens checked before the stop ids",
        "finish_precedence",
        length_before_stop,
        suites=("stop",),
    ),
    Mutant(
        "reservation_ignores_running",
        "preemption off: the reservation forgets the running requests' growth",
        "reservation",
        reservation_ignores_running,
        suites=("resources",),
    ),
    Mutant(
        "reservation_counts_held_twice",
        "preemption off: blocks already held counted again in the reservation",
        "reservation",
        reservation_counts_held_twice,
        suites=("resources",),
    ),
    Mutant(
        "hold_on_published_blocks",
        "same-step hold-back on blocks published long ago",
        "prefix_hold",
        hold_on_published_blocks,
        suites=("policy",),
    ),
)
