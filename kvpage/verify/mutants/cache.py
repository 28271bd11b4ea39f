"""Cache and block-table mutants (R23): each mutant patches ONE engine instance — never a branch in
the hot path, never a module-level change — to reproduce one classic paged-KV bug. The mutation
check runs the suites against each and demands that every mutant is caught and that its first
divergence is attributed (kvpage.verify.diff) to the class that matches its bug.

Mutants switch the engine's own guards off where a naive engine would not have them (state checks
in snapshot/pin, cu_seqlens validation): the point is that the verifier catches the bug from the
outside, by token-level differential traces, canaries and counters."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvpage.cache.block_pool import BlockState
from kvpage.cache.block_table import SnapshotEntry, TableSnapshot
from kvpage.cache.key_chain import BlockKey, BlockKeyChain, chain_digest
from kvpage.cache.namespace import CacheNamespace
from kvpage.engine.engine import LLMEngine
from kvpage.engine.runner import StepBatch
from kvpage.engine.scheduler import ScheduledSeq
from kvpage.verify.mutants.base import Mutant, _bind, _replace

_S = BlockState


# --- shared broken pieces ----------------------------------------------------------------------
def _naive_match(self, chain, max_blocks):
    """A flat hash-table lookup: no radix parent check (what the broken keys then exploit)."""
    hits = []
    for depth in range(min(max_blocks, len(chain.keys))):
        entry = self._confirmed(chain.keys[depth], chain.namespace_digest, depth)
        if entry is None or entry in hits:
            break
        hits.append(entry)
    return hits


def _unguarded_snapshot(engine: LLMEngine) -> None:
    """Snapshots without the readability check or pins (a naive engine has neither)."""
    cache, pool = engine.cache, engine.cache.pool

    def snapshot(self, table):
        self._next_snap_id += 1
        entries = tuple(
            SnapshotEntry(b, pool.blocks[b].generation, pool.blocks[b].valid_len)
            for b in table.block_ids
        )
        snap = TableSnapshot(
            self._next_snap_id,
            table.seq_id,
            table.epoch,
            table.num_tokens,
            entries,
            tuple(table.block_ids),
        )
        self.inflight[snap.snap_id] = snap
        return snap

    def release_snapshot(self, snap):
        self.inflight.pop(snap.snap_id, None)

    _bind(cache, "snapshot", snapshot)
    _bind(cache, "release_snapshot", release_snapshot)


def _force_free(pool, b, bump: bool = True) -> None:
    """Put a block on the free list whatever its state (the transition table is bypassed)."""
    pool.counts[b.state] -= 1
    pool.counts[_S.FREE] += 1
    b.state = _S.FREE
    b.owners.clear()
    b.ref_count = 0
    b.published = False
    b.valid_len = 0
    if bump:
        b.generation += 1
    pool.free_ids.append(b.block_id)


def _unchecked_set_valid(pool) -> None:
    """Writes into any block, shared or not. A block's fill only grows until it is freed, as
    in the honest pool; with several writers in one block, the one behind must not unfill
    what the others wrote (the real bug corrupts the KV, it does not fail the donor's
    publish). Owners cannot tell who writes: without a refcount a writer is not an owner."""

    def set_valid(self, block_id, valid_len):
        b = self.blocks[block_id]
        b.valid_len = max(b.valid_len, valid_len)

    _bind(pool, "set_valid", set_valid)


def _build_without_cu_check(engine: LLMEngine) -> None:
    """The runner, minus the cu_seqlens assertion (R10)."""
    _bind(engine.runner, "check_cu_seqlens", lambda self, cu_seqlens, num_tokens: None)


# --- the mutants -------------------------------------------------------------------------------
def share_partial_no_cow(engine: LLMEngine) -> None:
    """A new request joins a running request's blocks up to their common prefix, the partial
    last block included, and then appends into it in place: no copy-on-write (the passphrase
    experiment's sharing, R27, with a reference count but without copy-on-write)."""
    # Imported here: experiments sit above verify in the layering, and sharing.py imports the
    # broken pieces below from this module.
    from kvpage.experiments.sharing import share_running_prefix

    share_running_prefix(engine, refcount=True, cow=False)


def _tolerant_release(pool) -> None:
    original = pool.remove_owner

    def remove_owner(self, block_id, owner):
        if owner in self.blocks[block_id].owners:
            original(block_id, owner)

    _bind(pool, "remove_owner", remove_owner)


def fork_shares_partial_without_copy(engine: LLMEngine) -> None:
    """Parallel samples share the prompt's partial last block and each appends into it in
    place: copy-on-write relabels nothing and copies nothing (R6, R33)."""
    _bind(engine.cache, "_cow_needed", lambda self, table: False)
    _unchecked_set_valid(engine.cache.pool)


def no_refcount(engine: LLMEngine) -> None:
    """Releasing a shared block frees it for everyone (no reference count)."""
    pool, index = engine.cache.pool, engine.cache.index

    def remove_owner(self, block_id, owner):
        b = self.blocks[block_id]
        if owner not in b.owners or b.state is _S.FREE:
            return
        if len(b.owners) == 1:  # the last holder: the ordinary release
            b.owners.discard(owner)
            b.ref_count -= 1
            self._settle(b)
            return
        if b.block_id in index.by_block:
            index._remove(index.by_block[b.block_id])
        _force_free(self, b)

    _bind(pool, "remove_owner", remove_owner)
    _bind(pool, "pin", lambda self, block_id: None)
    _bind(pool, "unpin", lambda self, block_id: None)
    _unguarded_snapshot(engine)
    _bind(engine.cache, "_check_appendable", lambda self, table: None)


@dataclass(frozen=True, slots=True)
class _SaltBlindNamespace(CacheNamespace):
    def with_salt(self, cache_salt):  # the salt never reaches the digest
        return self


def namespace_missing_field(engine: LLMEngine) -> None:
    """The namespace key leaves out the per-request cache salt (tenant isolation, R5)."""
    ns = engine.namespace
    _replace(
        engine,
        "namespace",
        _SaltBlindNamespace(**{f.name: getattr(ns, f.name) for f in fields(ns) if f.init}),
    )


class _UnchainedKeyChain(BlockKeyChain):
    def _close_block(self) -> None:
        digest = chain_digest(self.namespace_digest, self._pending)  # own tokens only
        self.keys.append(BlockKey(int.from_bytes(digest[:8], "little") & self._mask, digest))
        self._pending = []


def block_key_own_tokens(engine: LLMEngine) -> None:
    """A block's key covers its own tokens only, not the prefix before it (R4)."""
    cache = engine.cache

    def new_key_chain(self, namespace):
        return _UnchainedKeyChain(namespace.digest(), self.block_size, self.fast_key_bits)

    _bind(cache, "new_key_chain", new_key_chain)
    _bind(cache.index, "match", _naive_match)


def fast_key_trusted(engine: LLMEngine) -> None:
    """A hit on the (narrow, 8-bit) fast key is served without confirming the full digest."""
    index = engine.cache.index
    _bind(index, "_confirmed", lambda self, key, namespace, depth: _fast_key_entry(self, key))
    _bind(index, "match", _naive_match)


def _fast_key_entry(index, key):
    """The joinable entry under a fast key, its digest never compared."""
    entry = index.entries.get(key.fast)
    if entry is None or index.pool.blocks[entry.block_id].state not in (
        _S.SHARED_READONLY,
        _S.CACHED,
    ):
        return None
    return entry


def stale_index_after_evict(engine: LLMEngine) -> None:
    """Eviction neither bumps the generation nor removes the index entry; hits trust entries."""
    pool, index = engine.cache.pool, engine.cache.index

    def to_free(self, b):
        _force_free(self, b, bump=False)

    def evict_one(self):
        import heapq

        while self._heap:
            tick, bid = heapq.heappop(self._heap)
            if self._is_evictable_leaf(bid, tick):
                entry = self.by_block.pop(bid)
                parent = entry.parent
                if parent is not None:
                    parent.num_children -= 1
                    if parent.num_children == 0 and (
                        self.pool.blocks[parent.block_id].state is _S.CACHED
                    ):
                        self._push(parent.block_id)
                self.pool.evict_cached(bid)  # the entry stays in self.entries: stale
                return bid
        raise RuntimeError("no evictable cached block")

    def confirmed(self, key, namespace, depth):
        entry = self.entries.get(key.fast)
        if entry is None or entry.digest != key.digest:
            return None
        return None if self.pool.blocks[entry.block_id].state is _S.FREE else entry

    _bind(pool, "_to_free", to_free)
    _bind(index, "evict_one", evict_one)
    _bind(index, "_confirmed", confirmed)
    _bind(index, "match", _naive_match)
    _bind(index, "publish", _publish_over_stale(index))


def _publish_over_stale(index):
    original = index.publish

    def publish(self, key, block_id, depth, parent, namespace):
        stale = self.entries.get(key.fast)
        if stale is not None and self.by_block.get(stale.block_id) is not stale:
            del self.entries[key.fast]  # a stale entry is simply overwritten
        return original(key, block_id, depth, parent, namespace)

    return publish


def restore_visible_before_copy(engine: LLMEngine) -> None:
    """A swapped-in table is published before its KV copy lands (the copy completes after the
    next step has already read the blocks)."""
    deferred: list = []
    original_step = engine.step

    def swap_in(self, seq):
        blocks = self.space.take(seq.seq_id)
        ids = self.cache.allocate_restoring(seq.table, seq.swapped_tokens)
        self.cache.finish_restore(seq.table)  # visible now ...
        seq.num_computed = seq.swapped_tokens
        self.counts["swap_ins"] += 1
        deferred.append((ids, blocks, seq))  # ... copied later

    def step(self):
        outputs = original_step()
        for ids, blocks, seq in deferred:
            self.storage.write_blocks(ids, blocks)
            seq.kv_restored = True
        deferred.clear()
        return outputs

    _bind(engine.swapper, "swap_in", swap_in)
    _bind(engine, "step", step)


def full_prefix_no_token_left(engine: LLMEngine) -> None:
    """A prompt of exactly k cached blocks is served whole: no token is left to compute, so the
    first token is sampled from whatever logits row the batch happens to end with."""

    def max_hit_blocks(self, prompt_len):
        return prompt_len // self.block_size  # every full block, even the prompt's last

    _bind(engine.cache, "max_hit_blocks", max_hit_blocks)
    _build_without_cu_check(engine)


def off_by_one_block_boundary(engine: LLMEngine) -> None:
    """The decode context length is one short when the new token opens a new block."""
    runner = engine.runner
    original = runner._decode_tables
    B = engine.config.block_size

    def decode_tables(self, tables, lens):
        return original(tables, [n - 1 if n % B == 1 else n for n in lens])

    _bind(runner, "_decode_tables", decode_tables)


def zero_length_cu_seqlens(engine: LLMEngine) -> None:
    """Requests retired in one step linger one more step in the batch as zero-length entries, and
    the runner derives per-sequence row ranges from the de-duplicated cu_seqlens: every later
    sequence is shifted onto its neighbour's block table (R10)."""
    sched, runner = engine.scheduler, engine.runner
    lingering: list = []
    original_remove, original_schedule = sched.remove, sched.schedule

    def remove(self, seq):
        position = self.running.index(seq) if seq in self.running else None
        original_remove(seq)
        if position is not None:
            lingering.append((position, seq))

    def schedule(self, step):
        out = original_schedule(step)
        for position, seq in lingering if out.scheduled else ():  # still in this step's batch
            out.scheduled.insert(min(position, len(out.scheduled)), ScheduledSeq(seq, 0, []))
        lingering.clear()
        return out

    original_metadata = runner._metadata

    def metadata(self, batch):
        deduped = sorted(set(batch.cu_seqlens_q))
        shifted = StepBatch(
            batch.scheduled,
            batch.input_ids,
            batch.positions,
            deduped,
            batch.snapshots,
            batch.sample_rows,
            batch.sample_seqs,
        )
        meta = original_metadata(shifted)
        slots = [s for item in batch.scheduled for s in item.slots]
        meta.slot_mapping = meta.slot_mapping.new_tensor(slots)
        return meta

    _bind(sched, "remove", remove)
    _bind(sched, "schedule", schedule)
    _build_without_cu_check(engine)
    _bind(runner, "_metadata", metadata)


CACHE_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "share_partial_no_cow",
        "shares a partial block and appends into it without CoW",
        "block_table",
        share_partial_no_cow,
    ),
    Mutant(
        "fork_shares_partial_without_copy",
        "forked samples write into their shared partial block without CoW",
        "block_table",
        fork_shares_partial_without_copy,
        suites=("parallel",),
    ),
    Mutant(
        "no_refcount",
        "frees a shared block when any holder releases it",
        "block_table",
        no_refcount,
    ),
    Mutant(
        "namespace_missing_field",
        "namespace digest omits the cache salt",
        "prefix_key",
        namespace_missing_field,
    ),
    Mutant(
        "block_key_own_tokens",
        "block key from the block's own tokens (no chaining)",
        "prefix_key",
        block_key_own_tokens,
    ),
    Mutant(
        "fast_key_trusted",
        "8-bit fast key trusted without the digest confirm",
        "prefix_key",
        fast_key_trusted,
        {"fast_key_bits": 8},
    ),
    Mutant(
        "stale_index_after_evict",
        "no generation bump; stale index entry after eviction",
        "prefix_key",
        stale_index_after_evict,
    ),
    Mutant(
        "restore_visible_before_copy",
        "swap-in table visible before the KV copy completes",
        "restore",
        restore_visible_before_copy,
    ),
    Mutant(
        "full_prefix_no_token_left",
        "full-prefix hit leaves no token to compute",
        "prefix_key",
        full_prefix_no_token_left,
    ),
    Mutant(
        "off_by_one_block_boundary",
        "decode context one short at a block boundary",
        "block_table",
        off_by_one_block_boundary,
    ),
    Mutant(
        "zero_length_cu_seqlens",
        "zero-length entries kept in cu_seqlens",
        "block_table",
        zero_length_cu_seqlens,
    ),
)
