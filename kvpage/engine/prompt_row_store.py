"""Prompt-logprob rows kept beside the cached blocks they were computed for.

A request that wants prompt logprobs needs, for every prompt position p, the top k of the
logits at p and the logprob of token p + 1. A prefix hit skips those positions, so the rows
must come from where the block was written: the request that computed a full block with rows
offers them here after its step, under the block's chained digest (namespace and every token up
to the block's end, so rows never cross a namespace or a prefix), and a later prompt-logprob
request takes a hit only over blocks whose rows are here. Rows are valid while the block they
were computed for is the live incarnation under that digest: (block id, generation) is checked
at every use, so a block evicted and written again never serves the old rows. What is missing
(a larger k than stored, another next token after the block's last position) is recomputed: the
hit stops before that block.

Each row is stored as the top `k` (k of the writer, up to ROW_TOP_BOUND) in the order the writer
got them, and the chosen next token with its logprob. The store holds at most one row set per
digest; stale ones are dropped as the store grows past the pool's size."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.cache.manager import KVCacheManager
from kvpage.engine.sequence import Sequence

# The most top entries kept per row: the server's logprobs bound (OpenAI allows up to 20).
ROW_TOP_BOUND = 20


@dataclass(frozen=True, slots=True)
class StoredRow:
    top: tuple[tuple[int, float], ...]  # the top entries, best first
    chosen: int  # the token after this position in the writer's prompt
    chosen_logprob: float


@dataclass(frozen=True, slots=True)
class StoredRows:
    """The rows of one full block: row i is for position block * B + i."""

    block_id: int  # the incarnation they were computed for
    generation: int
    k: int
    rows: tuple[StoredRow, ...]


@dataclass(frozen=True, slots=True)
class RowSource:
    """Where a hit's rows for one logical block came from (told to tracers)."""

    logical: int
    block_id: int
    generation: int


class PromptRowStore:
    def __init__(self, cache: KVCacheManager) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self._rows: dict[bytes, StoredRows] = {}
        self.served_blocks = 0  # row sets a hit used instead of recomputing them
        self.stored_blocks = 0

    def __len__(self) -> int:
        return len(self._rows)

    # --- lookup ----------------------------------------------------------------------------
    def key_of(self, seq: Sequence, logical: int) -> bytes:
        """What rows are kept under (a declared seam): the block's chained digest, so the
        namespace and every token before the block's end tell row sets apart."""
        return seq.chain.keys[logical].digest

    def lookup(self, seq: Sequence, logical: int) -> StoredRows | None:
        """The live rows of `seq`'s logical block, if any."""
        found = self._rows.get(self.key_of(seq, logical))
        if found is None or not self.is_live(found):
            return None
        return found

    def is_live(self, stored: StoredRows) -> bool:
        """Whether the block incarnation the rows were computed for still stands (a declared
        seam): same generation, still published."""
        block = self.cache.pool.blocks[stored.block_id]
        return block.generation == stored.generation and block.published

    def servable_blocks(self, seq: Sequence, max_blocks: int) -> int:
        """Leading blocks of `seq` whose rows are scored already or can be served: rows with at
        least the k it asks for, whose last row has its next token."""
        k, B = seq.params.prompt_logprobs, self.block_size
        done = len(seq.prompt_logprobs) - 1  # positions scored so far
        n = 0
        while n < min(max_blocks, len(seq.chain.keys)):
            if (n + 1) * B > done and self._usable(seq, n, k) is None:
                break
            n += 1
        return n

    def _usable(self, seq: Sequence, logical: int, k: int) -> StoredRows | None:
        stored = self.lookup(seq, logical)
        if stored is None or stored.k < k:
            return None
        last = stored.rows[-1]
        after = seq.prompt_ids[(logical + 1) * self.block_size]
        if last.chosen != after and all(t != after for t, _ in last.top):
            return None
        return stored

    # --- serving ---------------------------------------------------------------------------
    def serve(self, seq: Sequence, num_blocks: int) -> list[RowSource]:
        """Append the rows of `seq`'s first `num_blocks` blocks it has not scored yet, from the
        store (servable_blocks said they are there), and say where each block's came from."""
        k, B = seq.params.prompt_logprobs, self.block_size
        sources = []
        for logical in range(num_blocks):
            done = len(seq.prompt_logprobs) - 1
            if (logical + 1) * B <= done:
                continue
            stored = self._usable(seq, logical, k)
            if stored is None:
                break  # the rows stay short: positions never scored (only a broken hit cap)
            first = max(done, logical * B)
            seq.prompt_logprobs += self.rows_for(seq, stored, logical, first, k)
            sources.append(RowSource(logical, stored.block_id, stored.generation))
            self.served_blocks += 1
        return sources

    def rows_for(
        self, seq: Sequence, stored: StoredRows, logical: int, first: int, k: int
    ) -> list[dict[int, float]]:
        """The rows of positions [first, block end) in the request's shape (a declared seam):
        its top k, then its own next token, k + 1 entries when that one is outside the top k."""
        B = self.block_size
        out = []
        for p in range(first, (logical + 1) * B):
            row = stored.rows[p - logical * B]
            token = seq.prompt_ids[p + 1]
            entries = dict(row.top[:k])
            entries[token] = row.chosen_logprob if token == row.chosen else dict(row.top)[token]
            out.append(entries)
        return out

    # --- storing ---------------------------------------------------------------------------
    def offer(self, seq: Sequence, first_block: int) -> int:
        """After a step: keep the rows of `seq`'s full blocks from `first_block` on whose rows are
        all scored, under the live incarnation published with the block's digest (this seq's
        block, or the one that won the digest). Returns the next block to offer."""
        k, B = seq.params.prompt_logprobs, self.block_size
        if k > ROW_TOP_BOUND:
            return first_block
        done = len(seq.prompt_logprobs) - 1
        logical = first_block
        while (logical + 1) * B <= done and logical < len(seq.chain.keys):
            self._keep(seq, logical, k)
            logical += 1
        return logical

    def _keep(self, seq: Sequence, logical: int, k: int) -> None:
        key = seq.chain.keys[logical]
        holder = self.cache.published_block(key)
        if holder is None:
            return  # not cached (caching off, or its parent was not published): no hit can come
        digest = self.key_of(seq, logical)
        present = self._rows.get(digest)
        if present is not None and self.is_live(present) and present.k >= k:
            return
        B = self.block_size
        rows = []
        for p in range(logical * B, (logical + 1) * B):
            entries = list(seq.prompt_logprobs[p + 1].items())
            token = seq.prompt_ids[p + 1]
            rows.append(StoredRow(tuple(entries[:k]), token, seq.prompt_logprobs[p + 1][token]))
        self._rows[digest] = StoredRows(*holder, k, tuple(rows))
        self.stored_blocks += 1
        if len(self._rows) > 2 * self.cache.pool.num_blocks:
            self._rows = {d: s for d, s in self._rows.items() if self.is_live(s)}
