"""Shared helpers for the cache tests: a fake KV store that records, per slot, which token (with
its whole prefix and namespace) wrote it, so a test can read back what a table really points at."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvpage.cache import BlockKeyChain, BlockTable, CacheNamespace, KVCacheManager

BS = 16


def ns(**overrides) -> CacheNamespace:
    base = dict(model_revision="m@1", tokenizer_revision="t@1", block_size=BS)
    base.update(overrides)
    return CacheNamespace(**base)


@dataclass
class FakeKV:
    """slot -> (namespace digest, prefix tuple ending with the token at that slot)."""

    num_blocks: int
    block_size: int
    slots: list = field(default_factory=list)
    copies: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots = [None] * (self.num_blocks * self.block_size)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        self.copies.append((src, dst))
        self.slots[dst * bs:(dst + 1) * bs] = self.slots[src * bs:(src + 1) * bs]

    def write(self, slots: list[int], namespace: bytes, tokens: list[int], start: int) -> None:
        for i, slot in enumerate(slots):
            self.slots[slot] = (namespace, tuple(tokens[: start + i + 1]))

    def read_ok(self, table: BlockTable, namespace: bytes, tokens: list[int]) -> bool:
        bs = self.block_size
        return all(
            self.slots[table.block_ids[p // bs] * bs + p % bs] == (namespace, tuple(tokens[: p + 1]))
            for p in range(table.num_tokens)
        )


@dataclass
class Seq:
    table: BlockTable
    chain: BlockKeyChain
    tokens: list[int]
    cached: int


class Harness:
    """A manager plus fake KV; `prefill` does what the engine does for a new prompt."""

    def __init__(self, num_blocks: int = 11, block_size: int = BS, **kw):
        self.m = KVCacheManager(num_blocks, block_size, debug_checks=True, **kw)
        self.kv = FakeKV(num_blocks, block_size)
        self.m.copy_block_fn = self.kv.copy_block
        self.ns = ns(block_size=block_size)

    def prefill(self, seq_id: int, tokens: list[int], namespace: CacheNamespace | None = None,
                publish: bool = True) -> Seq:
        namespace = namespace or self.ns
        table = self.m.new_table(seq_id)
        chain = self.m.new_key_chain(namespace)
        chain.extend(tokens)
        cached = self.m.acquire_prefix(table, chain, len(tokens))
        slots = self.m.append_slots(table, len(tokens) - cached)
        self.kv.write(slots, namespace.digest(), tokens, cached)
        if publish:
            self.m.publish_full_blocks(table, chain)
        seq = Seq(table, chain, list(tokens), cached)
        assert self.kv.read_ok(table, namespace.digest(), tokens)
        return seq

    def decode(self, seq: Seq, new_tokens: list[int], namespace: CacheNamespace | None = None):
        namespace = namespace or self.ns
        start = seq.table.num_tokens
        slots = self.m.append_slots(seq.table, len(new_tokens))
        seq.tokens += new_tokens
        seq.chain.extend(new_tokens)
        self.kv.write(slots, namespace.digest(), seq.tokens, start)
        self.m.publish_full_blocks(seq.table, seq.chain)
        assert self.kv.read_ok(seq.table, namespace.digest(), seq.tokens)
        return slots

    def refs(self) -> list[tuple]:
        return [(b.block_id, b.ref_count, b.state, b.generation, b.valid_len, frozenset(b.owners))
                for b in self.m.pool.blocks]


@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def make_harness():
    return Harness


@pytest.fixture
def make_ns():
    return ns
