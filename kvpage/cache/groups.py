"""Per-layer-group KV: layers grouped by attention kind, each group with its own block tables over
one shared pool, and a sliding-window group giving back the blocks that fell out of its window.

Design (issue 24, items 2-3).

Storage. One pool of pages; a page holds the K/V of `rows` layers of ONE group (vLLM's hybrid
allocator). Layers are grouped by kind (global, or sliding window W), each kind split into groups
of `rows` layers, `rows` = the gcd of the kinds' layer counts, so no page row is padding: Gemma 3's
5 local : 1 global over 6 layers is 6 groups of 1 layer; 22 : 4 over 26 layers 13 groups of 2.
Layer l lives in row `row_of[l]` of the pages of group `group_of[l]` (`KVLayout.layer_map`). The
storage tensor is (rows, 2, num_blocks, B, KVH, D): a block id names one page, and a page a
window group frees is memory any group can take next. A model without two kinds of layer is one
group of every layer (rows = num_layers): today's layout, tables and code path, unchanged
(`KVLayout.plain`; so is any model with kv_layer_groups off: one table, nothing freed).

All-windowed models (Mistral / Qwen2 with `sliding_window` on every layer, windowed Phi-3).
There is no global layer, so group 0 is a WINDOW group (the smallest window's; one group when
every layer has the same window, the storage layout of a plain model). Of the two designs
weighed, (a) a window group 0 and (b) keeping group 0 global with an extra window table for
the layers, only (a) frees anything: under (b) the global table would keep every page of the
prefix, the memory the window no longer needs. Since the cache manager treats every group by
its kind alone (kvpage.cache.group_managers), group 0 needs no rule of its own. Readers of a
table skip NULL: the runner reads it as block 0 (masked), the debug written-slot check, held-block
events and hit reports, swap (`held_ids`), snapshots (their entries are the held blocks only, in
order; the tracer and provenance put them back at their logical positions), and the tracer
records a window group 0's view as a GroupView, so a trim bug in it is attributed to group 0.

Tables. `BlockTable.groups[g]` is group g's table, every group's the same length
(ceil(num_tokens / B)); a window group's leading entries that fell out of the window are
NULL_BLOCK, all of them below its cursor `trimmed[g]`. `block_ids` is group 0's, the table
events, traces, prefix-hit reports and swap accounting name. All groups of a table advance
together: one num_tokens, one publish cursor.

Freeing. A query at position p sees keys p - W + 1 .. p, so once the next token to compute is at
`start` no query will read a block whose last position is below start - W + 1:
`first_needed_block(start)` = max(0, start - W + 1) // B. Before each append (and before a swap-out)
the manager drops the window groups' entries below it (`trim`): the block's owner goes, a
published block goes CACHED (still hit-able, evictable), an unpublished one FREE. Freeing happens
before the step's allocation, so the pages come back in time to be reused by that very step.

Prefix hits (vLLM's hybrid rule). Every group publishes its full blocks under its own key (the
chained key salted by the group: one index, one LRU over all groups). A global group's entries form
the radix tree; a window group's are flat (no parent: its table no longer holds the
blocks before the window), so each is an evictable leaf on its own. A hit of h blocks needs the
whole prefix [0, h) in every global group, and in every window group only the blocks
[first_needed_block(h * B), h): the longest h that all groups satisfy is taken; the window
groups hold only those blocks (NULL before them). The global groups bound h first (their hits
are a walk from block 0); the window groups then look up each block below it
(`KVCacheManager.hit_tables`).

Preemption, swap and CoW work per group: a swap-out trims first and copies every group's held
pages (group by group, each in logical order); the restore allocates the
same pages again (the trim of the same position) and copies them back in the same order. CoW
copies a page (all its rows). Quantized KV: scales live per page row, invalidated per page, so
it is the same code. Tensor parallelism shards the KV heads of the same layout.

Attention. The runner builds one PagedAttentionMetadata per group (its slots, decode tables with
NULL entries read as block 0, which the window mask and the kernel's per-sequence start never
reach); `GroupedAttention` sends each layer to its group's backend with its row."""

from __future__ import annotations

import math
from dataclasses import dataclass

NULL_BLOCK = -1  # a table entry a window group gave back (or never took: before a hit's window)


@dataclass(frozen=True, slots=True)
class KVGroup:
    window: int | None  # None: a global group (holds the whole prefix)
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    rows: int  # layers per page
    layer_map: tuple[tuple[int, int], ...]  # layer -> (group, row in the group's pages)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def plain(self) -> bool:
        """One global group: today's single table, no per-group work at all."""
        return len(self.groups) == 1 and self.groups[0].window is None

    def pages_per_block(self, num_layers: int) -> int:
        """Pages that hold the memory of one whole-model block."""
        return num_layers // self.rows


def single_group(num_layers: int) -> KVLayout:
    """Every layer in one global group: one table per sequence, page row = layer."""
    layers = tuple(range(num_layers))
    return KVLayout((KVGroup(None, layers),), num_layers, tuple((0, i) for i in layers))


def kv_layout(num_layers: int, layer_windows: tuple[int | None, ...], enabled: bool) -> KVLayout:
    """Groups for a model whose layers have these windows (empty: all global). Plain (one
    global group) when disabled or when every layer is global."""
    windows = layer_windows or (None,) * num_layers
    kinds: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    if not enabled or list(kinds) == [None]:
        return single_group(num_layers)
    rows = math.gcd(*(len(v) for v in kinds.values()))
    # Global first: group 0. An all-windowed model's group 0 is its smallest window's group.
    order = ([None] if None in kinds else []) + sorted(w for w in kinds if w is not None)
    groups: list[KVGroup] = []
    layer_map: dict[int, tuple[int, int]] = {}
    for w in order:
        layers = kinds[w]
        for at in range(0, len(layers), rows):
            part = tuple(layers[at : at + rows])
            for row, layer in enumerate(part):
                layer_map[layer] = (len(groups), row)
            groups.append(KVGroup(w, part))
    return KVLayout(tuple(groups), rows, tuple(layer_map[i] for i in range(num_layers)))


def first_needed_block(start: int, window: int, block_size: int) -> int:
    """The first block a query at a position >= start can see under a window of `window` keys."""
    return max(0, start - window + 1) // block_size
