"""Preemption by swap (R11): `SwapSpace`, a bounded CPU store of whole sequences' KV blocks, and
`KVSwapper`, which moves a sequence's KV between the pool and that store. The scheduler is given the
swapper (not the engine), so scheduling depends on the cache and the swapper only."""

from __future__ import annotations

import time

from kvpage.cache.manager import KVCacheManager
from kvpage.engine.events import EngineObserver, SwappedIn, SwappedOut, emit, held_blocks, who
from kvpage.engine.sequence import Sequence
from kvpage.errors import SwapError
from kvpage.kv.storage import KVStorage
from kvpage.kv.swap_space import SwapSpace


class KVSwapper:
    """Swap-out / swap-in of one sequence's KV. `observers` is the engine's own list (shared, so
    an observer attached later is seen here too)."""

    def __init__(
        self,
        cache: KVCacheManager,
        storage: KVStorage,
        space: SwapSpace,
        observers: list[EngineObserver],
    ) -> None:
        self.cache, self.storage, self.space = cache, storage, space
        self.observers = observers
        self.counts = {"swap_outs": 0, "swap_ins": 0, "swap_failures": 0}

    def swap_out(self, seq: Sequence) -> bool:
        """Copy the KV to the swap space and give the blocks back; False (nothing changed) when
        the space is full or the copy fails, and the caller falls back to recompute (R21)."""
        if not self.space.can_store(len(seq.table.block_ids)):
            return False
        held = held_blocks(seq, self.cache.pool) if self.observers else None
        block_ids = self.cache.begin_evict(seq.table)
        try:
            self.space.write(seq.seq_id, self.storage.read_blocks(block_ids))
        except SwapError:
            self.cache.cancel_evict(seq.table)
            self.counts["swap_failures"] += 1
            return False
        seq.swapped_tokens = seq.num_computed
        seq.kv_restored = False
        self.cache.free_table(seq.table)
        self.counts["swap_outs"] += 1
        if held is not None:
            emit(self.observers, SwappedOut(**who(seq), num_tokens=seq.swapped_tokens, **held))
        return True

    def swap_in(self, seq: Sequence) -> None:
        """Allocate, copy back, and only then make the blocks readable."""
        start = time.perf_counter()
        blocks = self.space.take(seq.seq_id)
        ids = self.cache.allocate_restoring(seq.table, seq.swapped_tokens)
        self.storage.write_blocks(ids, blocks)
        for observer in self.observers:
            observer.on_kv_restored(seq, ids)
        seq.kv_restored = True
        self.cache.finish_restore(seq.table)  # only now may a step read these blocks
        seq.num_computed = seq.swapped_tokens
        self.counts["swap_ins"] += 1
        if self.observers:
            latency = time.perf_counter() - start
            event = SwappedIn(
                **who(seq),
                num_tokens=seq.swapped_tokens,
                **held_blocks(seq, self.cache.pool),
                latency_s=latency,
            )
            emit(self.observers, event)

    def discard(self, seq: Sequence) -> None:
        """A finished sequence's saved KV, if any, is dropped."""
        self.space.discard(seq.seq_id)
