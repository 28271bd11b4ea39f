"""Cache and block-table mutants: each plants one classic paged-KV bug in ONE engine instance
through a declared seam or a public method (kvpage.verify.mutants.base) — never a branch in the
hot path, never a module-level change. The mutation check runs the suites against each and demands
that every mutant is caught and that its first divergence is attributed (kvpage.verify.diff) to
the class that matches its bug.

Mutants switch the engine's own guards off where a naive engine would not have them (state checks
in snapshot/pin, the batch layout guard): the point is that the verifier catches the bug from the
outside, by token-level differential traces, canaries and counters."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvpage.cache.block_ops import SwapIn
from kvpage.cache.block_pool import BlockState
from kvpage.cache.key_chain import BlockKeyChain, chain_digest
from kvpage.cache.namespace import CacheNamespace
from kvpage.engine.engine import LLMEngine
from kvpage.engine.plan import ScheduledSeq, StepBatch
from kvpage.verify.mutants.base import Mutant, bind, plant, replace
from kvpage.verify.mutants.sharing import (
    share_running_prefix,
    unchecked_set_valid,
    unguarded_snapshots,
)

_S = BlockState


# --- shared broken pieces ----------------------------------------------------------------------
def naive_match(self, chain, max_blocks, group=0):
    """A flat hash-table lookup: no radix parent check (what the broken keys then exploit)."""
    hits = []
    for depth in range(min(max_blocks, len(chain.keys))):
        key = self.group_key(chain.keys[depth], group)
        entry = self.confirmed(key, chain.namespace_digest, depth)
        if entry is None or entry in hits:
            break
        hits.append(entry)
    return hits


def keep_generation_on_free(pool) -> None:
    """Every free leaves the block's generation as it was: the next owner's incarnation cannot
    be told from the last one's (a stale snapshot or index entry would pass every check)."""

    def keeping(name: str):
        original = getattr(pool, name)

        def release(self, block_id, *args):
            generation = self.blocks[block_id].generation
            original(block_id, *args)
            block = self.blocks[block_id]
            if block.state is _S.FREE and block.generation != generation:
                block.generation = generation
                self.stats.generation_bumps -= 1

        return release

    for name in ("remove_owner", "unpin", "evict_cached"):
        bind(pool, name, keeping(name))


def fast_key_entry(index, key):
    """The joinable entry under a fast key, its digest never compared."""
    entry = index.entries.get(key.fast)
    if entry is None or index.pool.blocks[entry.block_id].state not in (
        _S.SHARED_READONLY,
        _S.CACHED,
    ):
        return None
    return entry


def _without_batch_check(engine: LLMEngine) -> None:
    """The runner, minus its batch layout guard."""
    plant(engine, "runner.check_batch", lambda self, cu_seqlens, num_tokens: None)


# --- the mutants -------------------------------------------------------------------------------
def share_partial_no_cow(engine: LLMEngine) -> None:
    """A new request joins a running request's blocks up to their common prefix, the partial
    last block included, and then appends into it in place: no copy-on-write (the passphrase
    experiment's sharing, with a reference count but without copy-on-write)."""
    share_running_prefix(engine, refcount=True, cow=False)


def fork_shares_partial_without_copy(engine: LLMEngine) -> None:
    """Parallel samples share the prompt's partial last block and each appends into it in
    place: copy-on-write relabels nothing and copies nothing."""
    plant(engine, "cache.cow_needed", lambda self, table: False)
    unchecked_set_valid(engine.cache.pool)


def no_refcount(engine: LLMEngine) -> None:
    """Releasing a shared block frees it for everyone (no reference count)."""
    pool, index = engine.cache.pool, engine.cache.index
    release = pool.remove_owner

    def remove_owner(self, block_id, owner):
        b = self.blocks[block_id]
        if owner not in b.owners or b.state is _S.FREE:
            return  # a holder whose block another release already freed
        if len(b.owners) == 1:  # the last holder: the ordinary release
            release(block_id, owner)
            return
        entry = index.by_block.get(block_id)
        if entry is not None:
            index.remove(entry)
            b.published = False
        for other in sorted(b.owners):  # everyone's reference goes with one release
            release(block_id, other)

    bind(pool, "remove_owner", remove_owner)
    bind(pool, "pin", lambda self, block_id: None)
    bind(pool, "unpin", lambda self, block_id: None)
    unguarded_snapshots(engine)
    bind(engine.cache, "check_appendable", lambda self, table: None)


@dataclass(frozen=True, slots=True)
class _SaltBlindNamespace(CacheNamespace):
    def with_salt(self, cache_salt):  # the salt never reaches the digest
        return self


def namespace_missing_field(engine: LLMEngine) -> None:
    """The namespace key leaves out the per-request cache salt (tenant isolation)."""
    ns = engine.namespace
    values = {f.name: getattr(ns, f.name) for f in fields(ns) if f.init}
    replace(engine, "namespace", _SaltBlindNamespace(**values))


class _UnchainedKeyChain(BlockKeyChain):
    def block_digest(self, parent: bytes, tokens: list[int]) -> bytes:
        return chain_digest(self.namespace_digest, tokens)  # own tokens only


def block_key_own_tokens(engine: LLMEngine) -> None:
    """A block's key covers its own tokens only, not the prefix before it."""

    def new_key_chain(self, namespace):
        return _UnchainedKeyChain(namespace.digest(), self.block_size, self.fast_key_bits)

    plant(engine, "cache.new_key_chain", new_key_chain)
    plant(engine, "index.match", naive_match)


def fast_key_trusted(engine: LLMEngine) -> None:
    """A hit on the (narrow, 8-bit) fast key is served without confirming the full digest."""
    plant(engine, "index.confirmed", lambda self, key, namespace, depth: fast_key_entry(self, key))
    plant(engine, "index.match", naive_match)


def stale_index_after_evict(engine: LLMEngine) -> None:
    """Eviction neither bumps the generation nor removes the index entry; hits trust entries."""
    pool, index = engine.cache.pool, engine.cache.index
    keep_generation_on_free(pool)
    publish = index.publish

    def evict_one(self):
        bid = self.choose_victim()
        entry = self.by_block[bid]
        self.remove(entry)
        pool.evict_cached(bid)
        self.entries[entry.fast_key] = entry  # the entry stays, naming a FREE block: stale
        return bid

    def confirmed(self, key, namespace, depth):
        entry = self.entries.get(key.fast)
        if entry is None or entry.digest != key.digest:
            return None
        return None if self.pool.blocks[entry.block_id].state is _S.FREE else entry

    def publish_over_stale(self, key, block_id, depth, parent, namespace):
        stale = self.entries.get(key.fast)
        if stale is not None and self.by_block.get(stale.block_id) is not stale:
            del self.entries[key.fast]  # a stale entry is simply overwritten
        return publish(key, block_id, depth, parent, namespace)

    bind(index, "evict_one", evict_one)
    plant(engine, "index.confirmed", confirmed)
    plant(engine, "index.match", naive_match)
    bind(index, "publish", publish_over_stale)


def restore_visible_before_copy(engine: LLMEngine) -> None:
    """A swapped-in table is readable before its KV copy lands (the copy completes after the
    step that has already read the blocks)."""
    executor = engine.executor
    apply_ops, step = executor.apply_block_ops, engine.step
    deferred: list = []  # (swap-in, its saved KV), taken from the swap space on time

    def apply_block_ops(self, ops):
        for op in ops:
            if isinstance(op, SwapIn):
                deferred.append((op, self.swap_space.take(op.seq_id)))
        return apply_ops([op for op in ops if not isinstance(op, SwapIn)])

    def late_step(self):
        outputs = step()
        for op, saved in deferred:
            executor.storage.write_blocks(list(op.block_ids), saved)
            seq = self.requests.by_seq_id.get(op.seq_id)
            if seq is not None:
                seq.kv_restored = True
        deferred.clear()
        return outputs

    bind(executor, "apply_block_ops", apply_block_ops)
    bind(engine, "step", late_step)


def full_prefix_no_token_left(engine: LLMEngine) -> None:
    """A prompt of exactly k cached blocks is served whole: no token is left to compute, so the
    first token is sampled from whatever logits row the batch happens to end with."""
    plant(engine, "cache.max_hit_blocks", lambda self, prompt_len: prompt_len // self.block_size)
    _without_batch_check(engine)


def off_by_one_block_boundary(engine: LLMEngine) -> None:
    """The decode context length is one short when the new token opens a new block."""
    runner, B = engine.runner, engine.config.block_size
    build = runner.build

    def short_by_one(self, scheduled):
        batch = build(scheduled)
        batch.context_lens = [
            n - 1 if item.num_new_tokens == 1 and n % B == 1 else n
            for item, n in zip(batch.scheduled, batch.context_lens, strict=True)
        ]
        return batch

    bind(runner, "build", short_by_one)


def zero_length_cu_seqlens(engine: LLMEngine) -> None:
    """Requests retired in one step linger one more step in the batch as zero-length entries, and
    the runner derives per-sequence row ranges from the de-duplicated cu_seqlens: every later
    sequence is shifted onto its neighbour's block table."""
    sched, runner = engine.scheduler, engine.runner
    lingering: list = []
    remove, schedule, metadata = sched.remove, sched.schedule, runner.attention_metadata

    def linger(self, seq):
        position = self.running.index(seq) if seq in self.running else None
        remove(seq)
        if position is not None:
            lingering.append((position, seq))

    def schedule_with_lingering(self, step):
        plan = schedule(step)
        for position, seq in lingering if plan.scheduled else ():  # still in this step's batch
            plan.scheduled.insert(min(position, len(plan.scheduled)), ScheduledSeq(seq, 0, []))
        lingering.clear()
        return plan

    def deduplicated(self, batch):
        shifted = StepBatch(
            batch.scheduled,
            batch.input_ids,
            batch.positions,
            sorted(set(batch.cu_seqlens_q)),
            batch.snapshots,
            batch.sample_rows,
            batch.sample_seqs,
            batch.context_lens,
        )
        meta = metadata(shifted)
        slots = [s for item in batch.scheduled for s in item.slots]
        meta.slot_mapping = meta.slot_mapping.new_tensor(slots)
        return meta

    bind(sched, "remove", linger)
    bind(sched, "schedule", schedule_with_lingering)
    _without_batch_check(engine)
    bind(runner, "attention_metadata", deduplicated)


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
