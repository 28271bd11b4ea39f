"""`LLM.stats()`: the pool's block states, the cache's and the scheduler's counters, in one flat
dict of ints (the server's /metrics and the verifier's report read these names)."""

from __future__ import annotations

from kvpage.cache.manager import KVCacheManager
from kvpage.engine.scheduler import Scheduler
from kvpage.kv.swap_space import SwapSpace


def engine_stats(cache: KVCacheManager, sched: Scheduler, swap_space: SwapSpace) -> dict[str, int]:
    usage, cs = cache.usage(), cache.stats
    pre = sched.preemptions
    return {
        "num_blocks": usage.total,
        "free_blocks": usage.free,
        "private_blocks": usage.private,
        "shared_blocks": usage.shared,
        "cached_blocks": usage.cached,
        "evicting_blocks": usage.evicting,
        "restoring_blocks": usage.restoring,
        "index_entries": len(cache.index),
        "prefix_queries": sched.prefix_queries,
        "prefix_hits": sched.prefix_hits,
        "prefill_tokens": sched.prefill_tokens,  # prompt tokens fed to the model
        "corruptions": cs.corruption_count,
        "key_collisions": cs.key_collisions,
        "cow_copies": cs.cow_copies,
        "evictions": cs.evictions,
        "block_allocations": cs.allocations,
        "block_frees": cs.frees,
        "generation_bumps": cs.generation_bumps,
        "window_frees": cs.window_frees,  # blocks window layer groups gave back
        "preemptions": pre["recompute"] + pre["swap"],
        "preemptions_recompute": pre["recompute"],
        "preemptions_swap": pre["swap"],
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "swapped": len(sched.swapped),
        "swap_space_used": swap_space.used_blocks,
        **sched.swap_counts,
        **sched.counters,
    }
