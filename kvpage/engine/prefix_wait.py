"""Prefix sharing inside one step: who waits one step for a prefix being computed.

Blocks enter the prefix index only after the step that wrote their KV (`Scheduler.commit`), so N
requests that share a system prompt and are admitted in the same step would each compute it. Two
ways out:
(a) a request admitted in the same step joins the blocks an earlier request of that step is writing
    in this very forward pass. Correct here only through a property of another module: every layer
    writes all of the step's K/V slots before any sequence attends (model/paged_attention.py). A
    runner that splits a mixed batch into passes (cached-context chunks and decodes before fresh
    prefills, as many do), a kernel that writes each sequence's K/V inside its own attention, or
    asynchronous scheduling turns it into a read before the write. It also breaks the rule that a
    table becomes visible only after its KV is there: the joiner's table and the index would name
    blocks whose KV does not exist yet. And the gate would not guard it: on this runner such a join
    passes every check, and the provenance check sees a step as one batch, writes first; only
    tokens would show the day the runner changes (the mutant `same_step_join` is exactly that pair,
    and the gate catches it as a prefix_key divergence).
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
admission (`Scheduler.count_lookup`)."""

from __future__ import annotations

from kvpage.cache.manager import KVCacheManager
from kvpage.engine.plan import ScheduledSeq
from kvpage.engine.sequence import Sequence


class PrefixWait:
    def __init__(self, cache: KVCacheManager) -> None:
        self.cache = cache
        self._deferrals: dict[int, int] = {}  # seq id -> steps held back for a pending prefix

    def pending_keys(self, scheduled: list[ScheduledSeq]) -> set[bytes] | None:
        """Digests of the full blocks this step's chunks complete, published when it ends; None
        when prefix caching is off (nothing will be published, nobody waits)."""
        if not self.cache.enable_prefix_caching:
            return None
        pending: set[bytes] = set()
        for item in scheduled:
            self.add(pending, item.seq)
        return pending

    def add(self, pending: set[bytes], seq: Sequence) -> None:
        """What `publish_full_blocks` will publish for seq after this step (its table already
        counts the step's chunk): O(blocks completed), nothing for most decodes."""
        table, chain = seq.table, seq.chain
        if table.publish_blocked or not self.cache.index.is_enabled(chain.namespace_digest):
            return
        end = min(len(chain.keys), table.num_tokens // self.cache.block_size)
        pending.update(key.digest for key in chain.keys[table.num_published : end])

    def defer(self, seq: Sequence, pending: set[bytes]) -> bool:
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

    def forget(self, seq: Sequence) -> None:
        self._deferrals.pop(seq.seq_id, None)
