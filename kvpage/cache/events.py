"""Counters and audit events of the cache (R29).

The pool, the prefix index and the manager share one `CacheStats` object so that every counter lives
in one place; audit events are small frozen records handed to the manager's `audit` log (and its
listener: the engine, which names the request behind the sequence id and tells its observers) so
that every cache hit, refused hit and copy-on-write can be explained after the fact.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CacheStats:
    """Monotonic counters; rates are computed by whoever samples them."""

    # Every lookup, retries and re-prefills included; the engine's prefix_queries / prefix_hits
    # count each prompt once instead (its scheduler, at first admission).
    queries_tokens: int = 0  # prompt tokens offered to acquire_prefix
    hit_tokens: int = 0  # of those, tokens served from the cache
    corruption_count: int = 0  # fast key matched, full digest did not (R5)
    key_collisions: int = 0  # publish refused because the fast key is taken by another digest
    cow_copies: int = 0
    evictions: int = 0  # CACHED -> FREE
    generation_bumps: int = 0
    allocations: int = 0  # blocks taken from the free list
    frees: int = 0  # blocks returned to the free list


@dataclass(frozen=True, slots=True)
class HitEvent:
    """One prefix-cache hit: enough to re-derive which prompt tokens were not computed."""

    seq_id: int
    namespace: bytes  # namespace digest
    prefix_digest: bytes  # chained digest of the last block hit (covers the whole prefix)
    token_count: int  # cached tokens (a multiple of block_size)
    blocks_hit: tuple[int, ...]  # physical block ids, logical order
    last_block_full: bool  # observed in the pool; a hit on a partial block would be a bug
    prompt_tokens: int
    capped: bool  # the hit was shortened so the last prompt token is computed


@dataclass(frozen=True, slots=True)
class CorruptionEvent:
    """A fast-key hit whose full digest differed; the entry was not served (R5)."""

    namespace: bytes
    fast_key: int
    wanted_digest: bytes
    found_digest: bytes
    block_id: int
    depth: int  # logical block index of the lookup
    seq_id: int = -1  # whose lookup found it (the index knows keys only; the manager fills it in)


@dataclass(frozen=True, slots=True)
class CowEvent:
    """Copy-on-write of one shared partial block before a write."""

    seq_id: int
    logical_block: int
    src_block: int
    dst_block: int


AuditEvent = HitEvent | CorruptionEvent | CowEvent
