"""Cache-policy mutants (R7, R8, R5, R29, R34): eviction that forgets reuse, a digest confirmed at
the root only, prefix hits counted again when a request is re-admitted."""

from __future__ import annotations

from kvpage.cache.block_pool import BlockState
from kvpage.engine.engine import LLMEngine
from kvpage.verify.mutants.base import Mutant, _bind
from kvpage.verify.mutants.cache import _fast_key_entry, _naive_match


def fifo_eviction(engine: LLMEngine) -> None:
    """Evicts the CACHED leaf published first, however recently it was reused."""
    index = engine.cache.index

    def evict_one(self):
        for bid, entry in list(self.by_block.items()):  # dict order = publish order
            if self.pool.blocks[bid].state is BlockState.CACHED and entry.num_children == 0:
                self._remove(entry)
                self.pool.evict_cached(bid)
                return bid
        raise RuntimeError("no evictable cached block")

    _bind(index, "evict_one", evict_one)


def digest_confirmed_at_root_only(engine: LLMEngine) -> None:
    """The full digest is compared for the first block only; deeper hits trust the fast key."""
    index = engine.cache.index
    original = index._confirmed

    def confirmed(self, key, namespace, depth):
        if depth == 0:
            return original(key, namespace, depth)
        return _fast_key_entry(self, key)

    _bind(index, "_confirmed", confirmed)
    _bind(index, "match", _naive_match)


def hits_recounted_on_readmission(engine: LLMEngine) -> None:
    """A re-admitted request (re-prefill after recompute) counts its prefix lookup and hits
    again: every final admission is counted, not the first only."""

    def count_lookup(self, seq):
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed

    _bind(engine.scheduler, "_count_lookup", count_lookup)


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
)
