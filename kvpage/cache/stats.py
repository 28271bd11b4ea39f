"""Counters of the cache. The pool, the prefix index and the manager share one `CacheStats`
object so that every counter lives in one place; the engine reports them in `stats()`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CacheStats:
    """Monotonic counters; rates are computed by whoever samples them."""

    # Every lookup, retries and re-prefills included; the engine's prefix_queries / prefix_hits
    # count each prompt once instead (its scheduler, at first admission).
    queries_tokens: int = 0  # prompt tokens offered to acquire_prefix
    hit_tokens: int = 0  # of those, tokens served from the cache
    corruption_count: int = 0  # fast key matched, full digest did not: corruption, not a miss
    key_collisions: int = 0  # publish refused because the fast key is taken by another digest
    cow_copies: int = 0
    evictions: int = 0  # CACHED -> FREE
    generation_bumps: int = 0
    allocations: int = 0  # blocks taken from the free list
    frees: int = 0  # blocks returned to the free list
    window_frees: int = 0  # blocks a sliding-window layer group gave back (kvpage.cache.groups)
