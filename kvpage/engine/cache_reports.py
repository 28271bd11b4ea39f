"""The cache manager's records, carried into the step: the block operations it recorded (into
the plan, in order) and the copies and corruptions it found (to the observers, as events)."""

from __future__ import annotations

from kvpage.cache.block_ops import CopyBlock
from kvpage.cache.manager import KVCacheManager
from kvpage.engine.events import CacheCorruption, CowCopy, EngineObserver, emit, who
from kvpage.engine.plan import StepPlan
from kvpage.engine.requests import Requests


class CacheReports:
    def __init__(
        self, cache: KVCacheManager, requests: Requests, observers: list[EngineObserver]
    ) -> None:
        self.cache = cache
        self.requests = requests
        self.observers = observers  # the engine's list, shared

    def drain(self, plan: StepPlan) -> None:
        """Move the cache's recorded block ops into the plan (keeping their order) and report
        the copies: a copy-on-write is observed when it is decided, as the pool then stands."""
        ops = self.cache.take_block_ops()
        plan.block_ops += ops
        for op in ops:
            if isinstance(op, CopyBlock):
                self._report_copy(op)

    def _report_copy(self, op: CopyBlock) -> None:
        for observer in self.observers:
            observer.on_kv_copy(op.src, op.dst)
        seq = self.requests.by_seq_id.get(op.seq_id)
        if self.observers and seq is not None:
            fields = dict(logical_block=op.logical_block, src_block=op.src, dst_block=op.dst)
            emit(self.observers, CowCopy(**who(seq), **fields))

    def corruptions(self) -> None:
        for seq_id, found in self.cache.take_corruptions():
            seq = self.requests.by_seq_id.get(seq_id)
            if self.observers and seq is not None:
                event = CacheCorruption(
                    **who(seq),
                    fast_key=found.fast_key,
                    wanted_digest=found.wanted_digest.hex(),
                    found_digest=found.found_digest.hex(),
                    block_id=found.block_id,
                    depth=found.depth,
                )
                emit(self.observers, event)
