"""Hypothesis stateful test of the cache manager against a simple model of who holds what.

The model keeps, per sequence, its namespace and tokens; a fake KV store records in every slot the
(namespace, whole prefix) that wrote it. After every rule: the invariant checker passes over the
model's tables, every live sequence reads back exactly its own history through its block table
(isolation, the one invariant), every in-flight snapshot still sees what it saw, and a prompt whose
leading blocks are published by a live sequence of the same namespace is never a miss.
"""

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpage.cache import (
    BlockKeyChain,
    BlockState,
    BlockTable,
    CacheNamespace,
    CopyBlock,
    KVCacheManager,
)
from kvpage.errors import InvariantViolation, OutOfBlocks

BS = 4
NUM_BLOCKS = 10
BASE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # shared-prefix material
NAMESPACES = [
    CacheNamespace("m", "t", block_size=BS),
    CacheNamespace("m", "t", block_size=BS, cache_salt="other-tenant"),
]
S = BlockState


@dataclass
class SeqModel:
    table: BlockTable
    chain: BlockKeyChain
    ns: int
    tokens: list[int]
    swapped: bool = False


class CacheMachine(RuleBasedStateMachine):
    @initialize(bits=st.sampled_from([64, 64, 3]))
    def setup(self, bits):
        self.m = KVCacheManager(NUM_BLOCKS, BS, fast_key_bits=bits)
        for name in ("append_slots", "make_writable"):
            self._apply_copies_after(name)
        self.kv: list = [None] * (NUM_BLOCKS * BS)
        self.seqs: dict[int, SeqModel] = {}
        self.snaps: list[tuple] = []  # (snapshot, expected slot contents)
        self.next_id = 0
        self.copies = 0

    # --- fake device ---------------------------------------------------------------------
    def _apply_copies_after(self, name: str) -> None:
        """The manager records copy-on-writes as ops; the fake device applies them at once."""
        call = getattr(self.m, name)

        def applying(*args):
            result = call(*args)
            for op in self.m.take_block_ops():
                if isinstance(op, CopyBlock):
                    self._copy(op.src, op.dst)
            return result

        setattr(self.m, name, applying)

    def _copy(self, src, dst):
        self.copies += 1
        self.kv[dst * BS : (dst + 1) * BS] = self.kv[src * BS : (src + 1) * BS]

    def _write(self, seq: SeqModel, slots, start):
        digest = NAMESPACES[seq.ns].digest()
        for i, slot in enumerate(slots):
            self.kv[slot] = (digest, tuple(seq.tokens[: start + i + 1]))

    def _expected(self, seq: SeqModel, pos):
        return (NAMESPACES[seq.ns].digest(), tuple(seq.tokens[: pos + 1]))

    def _frozen(self):
        return (
            [
                (b.ref_count, b.state, b.generation, b.valid_len, frozenset(b.owners))
                for b in self.m.pool.blocks
            ],
            list(self.m.pool.free_ids),
            len(self.m.index),
        )

    def _live(self):
        return [s for s in self.seqs.values() if not s.swapped]

    def _pick(self, i, live_only=True):
        pool = self._live() if live_only else list(self.seqs.values())
        return pool[i % len(pool)]

    # --- rules ---------------------------------------------------------------------------
    @rule(
        ns=st.integers(0, 1),
        shared=st.integers(0, len(BASE)),
        tail=st.lists(st.integers(0, 2), max_size=6),
    )
    def new_seq(self, ns, shared, tail):
        tokens = BASE[:shared] + tail or [0]
        sid, self.next_id = self.next_id, self.next_id + 1
        table = self.m.new_table(sid)
        chain = self.m.new_key_chain(NAMESPACES[ns])
        chain.extend(tokens)
        expect_min = self._expected_hit(ns, tokens)
        cached = self.m.acquire_prefix(table, chain, len(tokens))
        assert cached % BS == 0 and cached <= len(tokens) - 1
        assert cached >= expect_min
        event("new_seq: prefix hit" if cached else "new_seq: miss")
        seq = SeqModel(table, chain, ns, tokens)
        self.seqs[sid] = seq
        for p in range(cached):  # hit blocks hold exactly this prompt's history
            assert self.kv[table.block_ids[p // BS] * BS + p % BS] == self._expected(seq, p)
        before = self._frozen()
        try:
            slots = self.m.append_slots(table, len(tokens) - cached)
        except OutOfBlocks:
            event("new_seq: out of blocks")
            assert self._frozen() == before
            self.m.free_table(table)
            del self.seqs[sid]
            return
        self._write(seq, slots, cached)
        self.m.publish_full_blocks(table, chain)

    def _expected_hit(self, ns, tokens):
        """Blocks some live sequence has published for the same namespace and tokens."""
        if not self.m.index.is_enabled(NAMESPACES[ns].digest()) or self.m.fast_key_bits < 64:
            return 0
        best = 0
        cap = (len(tokens) - 1) // BS
        for s in self._live():
            if s.ns != ns:
                continue
            k = 0
            while (
                k < min(cap, s.table.num_published)
                and s.tokens[k * BS : (k + 1) * BS] == tokens[k * BS : (k + 1) * BS]
            ):
                k += 1
            best = max(best, k)
        return best * BS

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 50), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, i, new):
        seq = self._pick(i)
        start = seq.table.num_tokens
        last = self.m.pool.blocks[seq.table.block_ids[-1]] if seq.table.block_ids else None
        will_copy = bool(start % BS) and last.state is S.SHARED_READONLY
        copies, before = self.copies, self._frozen()
        can = self.m.can_append(seq.table, len(new))
        try:
            slots = self.m.append_slots(seq.table, len(new))
        except OutOfBlocks:
            assert not can and self._frozen() == before
            return
        assert can
        assert self.copies - copies == int(will_copy)
        event("append: copy-on-write" if will_copy else "append: in place")
        seq.tokens += new
        seq.chain.extend(new)
        self._write(seq, slots, start)
        self.m.publish_full_blocks(seq.table, seq.chain)

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 50))
    def fork(self, i):
        parent = self._pick(i)
        sid, self.next_id = self.next_id, self.next_id + 1
        child = self.m.fork(parent.table, sid)
        self.seqs[sid] = SeqModel(child, parent.chain.copy(), parent.ns, list(parent.tokens))

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 50), j=st.integers(0, 50))
    def copy_on_write(self, i, j):
        seq = self._pick(i)
        idx = j % len(seq.table.block_ids)
        b = self.m.pool.blocks[seq.table.block_ids[idx]]
        if b.valid_len == BS or b.state is not S.SHARED_READONLY:
            try:
                self.m.make_writable(seq.table, idx)
                assert b.state is S.PRIVATE_WRITABLE  # only a no-op is allowed here
            except InvariantViolation:
                assert b.valid_len == BS or b.state is not S.PRIVATE_WRITABLE
            return
        copies = self.copies
        try:
            new = self.m.make_writable(seq.table, idx)
        except OutOfBlocks:
            return
        assert self.m.make_writable(seq.table, idx) == new  # twice: still one copy
        assert self.copies == copies + 1

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 50))
    def free(self, i):
        seq = self._pick(i, live_only=False)
        if not seq.swapped:
            self.m.free_table(seq.table)
        del self.seqs[seq.table.seq_id]

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 50))
    def snapshot(self, i):
        seq = self._pick(i)
        snap = self.m.snapshot(seq.table)
        self.m.validate_snapshot(snap)
        expect = [self.kv[e.block_id * BS + o] for e in snap.entries for o in range(e.valid_len)]
        self.snaps.append((snap, expect))

    @precondition(lambda self: self.snaps)
    @rule(i=st.integers(0, 50))
    def release(self, i):
        snap, _ = self.snaps.pop(i % len(self.snaps))
        self.m.release_snapshot(snap)

    # Only while something is CACHED: an evict of nothing is an exact unit test
    # (test_prefix_cache.test_evict_with_nothing_cached_takes_nothing); drawn here it was a third
    # of all steps.
    @precondition(lambda self: self.m.pool.counts[S.CACHED])
    @rule(n=st.integers(1, 4))
    def evict(self, n):
        cached = self.m.usage().cached
        assert len(self.m.evict(n)) == min(n, cached)
        event("evict: something")

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 50))
    def swap_out(self, i):
        seq = self._pick(i)
        assert self.m.begin_evict(seq.table) == seq.table.block_ids
        self.m.free_table(seq.table)
        seq.swapped = True

    @precondition(lambda self: any(s.swapped for s in self.seqs.values()))
    @rule(i=st.integers(0, 50))
    def swap_in(self, i):
        swapped = [s for s in self.seqs.values() if s.swapped]
        seq = swapped[i % len(swapped)]
        before = self._frozen()
        try:
            ids = self.m.allocate_restoring(seq.table, len(seq.tokens))
        except OutOfBlocks:
            assert self._frozen() == before
            return
        try:
            self.m.snapshot(seq.table)
            raise AssertionError("a RESTORING table must not be readable")
        except InvariantViolation:
            pass
        slots = [bid * BS + o for bid in ids for o in range(BS)][: len(seq.tokens)]
        self._write(seq, slots, 0)
        self.m.finish_restore(seq.table)
        event("swap_in: restored")
        seq.swapped = False
        self.m.publish_full_blocks(seq.table, seq.chain)

    @rule(ns=st.integers(0, 1), on=st.booleans())
    def kill_switch(self, ns, on):
        self.m.set_namespace_enabled(NAMESPACES[ns].digest(), on)

    # --- checks after every rule -----------------------------------------------------------
    @invariant()
    def cache_is_consistent(self):
        if not hasattr(self, "m"):
            return
        live = self._live()
        self.m.check_invariants([s.table for s in live])
        assert set(self.m.live_tables) == {s.table.seq_id for s in live}
        u = self.m.usage()
        assert u.free + u.private + u.shared + u.cached + u.evicting + u.restoring == NUM_BLOCKS
        assert self.m.num_free_blocks() == u.free + u.cached

    @invariant()
    def every_sequence_reads_its_own_history(self):
        if not hasattr(self, "m"):
            return
        for seq in self._live():
            ids = seq.table.block_ids
            for p in range(seq.table.num_tokens):
                assert self.kv[ids[p // BS] * BS + p % BS] == self._expected(seq, p), (
                    f"seq {seq.table.seq_id} position {p} reads foreign KV"
                )

    @invariant()
    def snapshots_see_what_they_saw(self):
        if not hasattr(self, "m"):
            return
        for snap, expect in self.snaps:
            now = [self.kv[e.block_id * BS + o] for e in snap.entries for o in range(e.valid_len)]
            assert now == expect
            for e in snap.entries:
                assert self.m.pool.blocks[e.block_id].generation == e.generation


# 1000 runs of up to 30 steps (2000 of 20 before): as many CoW appends, swap restores, evictions
# and prefix hits per run of the test, a third less time (fewer, longer runs: less of it spent
# in Hypothesis between runs and in the shallow states every run starts from).
CacheMachine.TestCase.settings = settings(
    max_examples=1000,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheStateful = CacheMachine.TestCase
