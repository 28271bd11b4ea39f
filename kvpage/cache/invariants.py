"""Debug invariant checker: cheap enough to run after every step in tests.

Recomputes, from the tables and in-flight snapshots alone, who should hold each block, and compares
with the pool and the index. Raises InvariantViolation listing every fact that does not hold.
Cost: O(pool blocks + table entries + index entries).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvpage.cache.block_pool import BlockPool, BlockState
from kvpage.cache.block_table import BlockTable, TableSnapshot, blocks_for
from kvpage.cache.groups import NULL_BLOCK
from kvpage.cache.prefix_index import PrefixIndex
from kvpage.errors import InvariantViolation

_S = BlockState


def check_invariants(
    pool: BlockPool,
    tables: Iterable[BlockTable],
    index: PrefixIndex | None = None,
    snapshots: Iterable[TableSnapshot] = (),
    windows: tuple[int | None, ...] = (),
) -> None:
    """`windows`: each layer group's window (None: full attention; kvpage.cache.groups), every
    group full attention by default."""
    tables = list(tables)
    problems: list[str] = []
    problems += _check_counts(pool)
    problems += _check_tables(pool, tables, index, windows)
    problems += _check_refs(pool, tables, list(snapshots))
    if index is not None:
        problems += _check_index(pool, index)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise InvariantViolation(f"{len(problems)} cache invariant(s) broken:\n  {shown}{more}")


def _check_counts(pool: BlockPool) -> list[str]:
    out = []
    states = [b.state for b in pool.blocks]
    for state in BlockState:
        actual = states.count(state)  # by identity: no Enum hashing per block
        if actual != pool.counts[state]:
            out.append(f"usage count {state.name}={pool.counts[state]} but {actual} blocks")
    if sum(pool.counts.values()) != pool.num_blocks:
        out.append(f"state counts sum to {sum(pool.counts.values())} != total {pool.num_blocks}")
    free = list(pool.free_ids)
    if len(set(free)) != len(free):
        out.append(f"free list has duplicates: {sorted(free)}")
    free_state = {b.block_id for b in pool.blocks if b.state is _S.FREE}
    if set(free) != free_state:
        out.append(f"free list {sorted(free)} != FREE blocks {sorted(free_state)}")
    for b in pool.blocks:
        clean = not (b.ref_count or b.pins or b.owners or b.valid_len or b.published)
        if clean and b.state is _S.FREE:
            continue  # a clean FREE block (most of a large pool): every rule below holds
        out += _check_block_state(pool, b)
    return out


def _check_block_state(pool: BlockPool, b) -> list[str]:
    bid, s, n_own = b.block_id, b.state, len(b.owners)
    out = []
    if not 0 <= b.valid_len <= pool.block_size:
        out.append(f"block {bid}: valid_len {b.valid_len} outside 0..{pool.block_size}")
    if b.ref_count != n_own + b.pins:
        out.append(f"block {bid}: ref_count {b.ref_count} != owners {n_own} + pins {b.pins}")
    if (s in (_S.FREE, _S.CACHED)) != (b.ref_count == 0):
        out.append(f"block {bid}: state {s.name} with ref_count {b.ref_count}")
    if s is _S.FREE and (b.valid_len or b.published):
        out.append(f"block {bid}: FREE but valid_len={b.valid_len} published={b.published}")
    if (s is _S.CACHED) and not b.published:
        out.append(f"block {bid}: CACHED but not published")
    if s is _S.PRIVATE_WRITABLE and (n_own > 1 or b.published):
        out.append(
            f"block {bid}: PRIVATE_WRITABLE with owners {sorted(b.owners)} published={b.published}"
        )
    if s is _S.SHARED_READONLY and n_own < 2 and not b.published:
        out.append(f"block {bid}: SHARED_READONLY with one owner and unpublished")
    if s in (_S.EVICTING, _S.RESTORING) and (n_own > 1 or b.published):
        out.append(f"block {bid}: {s.name} with owners {sorted(b.owners)} published={b.published}")
    if n_own == 0 and b.ref_count > 0 and b.pins == 0:
        out.append(f"block {bid}: referenced by nobody but ref_count {b.ref_count}")
    return out


def _check_tables(
    pool: BlockPool, tables: list[BlockTable], index: PrefixIndex | None, windows: tuple
) -> list[str]:
    out = []
    bs = pool.block_size
    seen_seq: set[int] = set()
    for t in tables:
        if t.seq_id in seen_seq:
            out.append(f"two live tables for seq {t.seq_id}")
        seen_seq.add(t.seq_id)
        held = t.held_ids()
        if len(set(held)) != len(held):
            out.append(f"seq {t.seq_id}: a block appears twice in {t.groups}")
        for g, ids in enumerate(t.groups):
            if len(ids) != blocks_for(t.num_tokens, bs):
                out.append(f"seq {t.seq_id} group {g}: {len(ids)} blocks for {t.num_tokens} tokens")
            window = windows[g] if g < len(windows) else None
            out += _check_group(pool, None if window else index, t, g, window)
    return out


def _check_group(
    pool: BlockPool, index: PrefixIndex | None, t: BlockTable, g: int, window: int | None
) -> list[str]:
    """One layer group's table: NULL exactly below its trim cursor (a full-attention group has
    none), each held entry sound; a full-attention group's published entries chain in the
    index (`index`; a window group's are flat)."""
    out = []
    ids, cut = t.groups[g], t.trimmed[g]
    if window is None and cut:
        out.append(f"seq {t.seq_id} group {g}: a full-attention group trimmed at {cut}")
    if any(b != NULL_BLOCK for b in ids[:cut]) or NULL_BLOCK in ids[cut:]:
        out.append(f"seq {t.seq_id} group {g}: NULL and held entries split at {cut}: {ids}")
    for i, bid in enumerate(ids):
        if bid != NULL_BLOCK:
            out += [f"group {g}: {p}" for p in _check_entry(pool, index, t, ids, i, bid)]
    return out


def _check_entry(
    pool: BlockPool, index: PrefixIndex | None, t: BlockTable, ids: list[int], i: int, bid: int
) -> list[str]:
    b = pool.blocks[bid]
    bs = pool.block_size
    out = []
    if b.state in (_S.FREE, _S.CACHED):
        out.append(f"seq {t.seq_id} block[{i}]={bid} reaches a {b.state.name} block")
    if t.seq_id not in b.owners:
        out.append(f"seq {t.seq_id} block[{i}]={bid} but owners are {sorted(b.owners)}")
    expect = min(bs, t.num_tokens - i * bs)
    if b.state is not _S.RESTORING and b.valid_len != expect:
        out.append(f"seq {t.seq_id} block[{i}]={bid}: valid_len {b.valid_len}, table has {expect}")
    if index is not None and b.published:
        entry = index.by_block.get(bid)
        want_parent = None if i == 0 else index.by_block.get(ids[i - 1])
        if entry is None or entry.depth != i or entry.parent is not want_parent:
            out.append(
                f"seq {t.seq_id} block[{i}]={bid}: published but its index entry does not "
                f"chain to block[{i - 1}] of the same table"
            )
    if i < t.num_published and not b.published:
        out.append(f"seq {t.seq_id} block[{i}]={bid}: below the publish cursor but unpublished")
    return out


def _check_refs(
    pool: BlockPool, tables: list[BlockTable], snapshots: list[TableSnapshot]
) -> list[str]:
    out = []
    owners: dict[int, set[int]] = {}
    for t in tables:
        for bid in t.held_ids():
            owners.setdefault(bid, set()).add(t.seq_id)
    pins: dict[int, int] = {}
    for s in snapshots:
        for e in _snapshot_entries(s):
            pins[e.block_id] = pins.get(e.block_id, 0) + 1
    free = set(pool.free_ids)
    for s in snapshots:
        for e in _snapshot_entries(s):
            if pool.blocks[e.block_id].generation != e.generation:
                out.append(
                    f"snapshot {s.snap_id} (seq {s.seq_id}): block {e.block_id} "
                    f"generation moved {e.generation} -> "
                    f"{pool.blocks[e.block_id].generation} while pinned"
                )
    nobody: frozenset[int] = frozenset()
    for b in pool.blocks:
        want, pinned = owners.get(b.block_id, nobody), pins.get(b.block_id, 0)
        if b.owners != want:
            out.append(
                f"block {b.block_id}: owners {sorted(b.owners)} but held by tables {sorted(want)}"
            )
        if b.pins != pinned:
            out.append(
                f"block {b.block_id}: pins {b.pins} but {pinned} in-flight snapshot references"
            )
        if b.ref_count != len(want) + pinned:
            out.append(
                f"block {b.block_id}: ref_count {b.ref_count} != references held "
                f"{len(want) + pinned}"
            )
        if b.ref_count and b.block_id in free:
            out.append(f"block {b.block_id}: on the free list with ref_count {b.ref_count}")
    return out


def _snapshot_entries(s: TableSnapshot) -> list:
    return [e for group in s.group_entries() for e in group]


def _check_index(pool: BlockPool, index: PrefixIndex) -> list[str]:
    out = []
    children: Counter[int] = Counter()
    for fast, e in index.entries.items():
        b = pool.blocks[e.block_id]
        if fast != e.fast_key or index.by_block.get(e.block_id) is not e:
            out.append(f"index entry for block {e.block_id}: maps are inconsistent")
        if b.generation != e.generation:
            out.append(
                f"index entry for block {e.block_id}: generation {e.generation} but block "
                f"is at {b.generation} (freed block still reachable from the index)"
            )
        if b.state not in (_S.SHARED_READONLY, _S.CACHED) or not b.published:
            out.append(f"index entry for block {e.block_id}: block is {b.state.name}")
        if b.valid_len != pool.block_size:
            out.append(f"index entry for block {e.block_id}: partial block ({b.valid_len})")
        if e.parent is not None:
            children[id(e.parent)] += 1
            if index.entries.get(e.parent.fast_key) is not e.parent:
                out.append(f"index entry for block {e.block_id}: parent evicted before child")
            elif b.ref_count and not pool.blocks[e.parent.block_id].ref_count:
                out.append(f"index entry for block {e.block_id}: held below an unheld parent")
    for e in index.entries.values():
        if e.num_children != children[id(e)]:
            out.append(
                f"index entry for block {e.block_id}: num_children {e.num_children} != "
                f"{children[id(e)]}"
            )
    if len(index.by_block) != len(index.entries):
        out.append(f"index has {len(index.entries)} keys but {len(index.by_block)} blocks")
    published = {b.block_id for b in pool.blocks if b.published}
    if published != set(index.by_block):
        out.append(f"published blocks {sorted(published)} != indexed {sorted(index.by_block)}")
    leaves = set(index.evictable_leaves())
    for e in index.entries.values():
        is_leaf = pool.blocks[e.block_id].state is _S.CACHED and e.num_children == 0
        if is_leaf != (e.block_id in leaves):
            out.append(f"block {e.block_id}: evictable-leaf heap disagrees (leaf={is_leaf})")
    return out
