"""Per-layer-group KV mutants (kvpage.cache.groups), on a model with global and sliding-window
layers (builtin:tiny-hybrid): the window trim off by one, a block freed while its window still
reaches it, a global layer reading a window group's table, a prefix hit that takes a window
group's blocks from outside the window. The two trim mutants apply to an all-windowed model too
(Mistral: one window group 0). Each shows in the step's group views before (or
without) any token differing, so each must be attributed to layer_group."""

from __future__ import annotations

from kvpage.cache.block_table import blocks_for
from kvpage.cache.groups import NULL_BLOCK, first_needed_block
from kvpage.config import ModelConfig
from kvpage.engine.engine import LLMEngine
from kvpage.verify.mutants.base import Mutant, plant, replace

SUITES = ("layer_groups",)


def _not_hybrid(cfg: ModelConfig) -> str | None:
    windows = set(cfg.layer_windows or (None,))
    if None in windows and len(windows) > 1:
        return None
    return "the model has no global and sliding-window layers: one KV group, nothing to trim"


def _no_window(cfg: ModelConfig) -> str | None:
    if any(w is not None for w in cfg.layer_windows or ()):
        return None
    return "the model has no sliding-window layer: nothing to trim"


def _trim_from(first_block):
    """A trim whose first kept block is `first_block(start, window, block_size)`."""

    def trim(self, table):
        bs, start = self.block_size, table.num_tokens
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            lo = min(first_block(start, window, bs), start // bs)  # never the block written next
            ids, cursor = table.groups[g], table.trimmed[g]
            for j in range(cursor, lo):
                if ids[j] != NULL_BLOCK:
                    self.pool.remove_owner(ids[j], table.seq_id)
                    ids[j] = NULL_BLOCK
            table.trimmed[g] = max(lo, cursor)

    return trim


def window_off_by_one(engine: LLMEngine) -> None:
    """The trim counts the window as W - 1 keys: the block holding the window's first key goes
    when that key is its last position."""
    plant(engine, "cache.trim", _trim_from(lambda s, w, bs: first_needed_block(s + 1, w, bs)))


def freed_inside_window(engine: LLMEngine) -> None:
    """The trim gives back one block more than the window allows, every time."""
    plant(engine, "cache.trim", _trim_from(lambda s, w, bs: first_needed_block(s, w, bs) + 1))


def global_reads_local_table(engine: LLMEngine) -> None:
    """The global layers' attention reads (and writes) the first window group's table."""
    layer_map = engine.runner.layer_map
    window_group = next((g for g, _ in layer_map if g != 0), 0)
    wrong = tuple((window_group, row) if g == 0 else (g, row) for g, row in layer_map)
    replace(engine.runner, "layer_map", wrong)


def hit_reuses_blocks_outside_window(engine: LLMEngine) -> None:
    """A hit whose window blocks are looked up one window further back: the window group's
    table takes blocks published for positions outside the window, as if they were its own."""
    cache = engine.cache
    original = cache.hit_tables
    shift = blocks_for(max(w or 0 for w in cache.windows), cache.block_size)

    def hit_tables(self, chain, max_blocks):
        out = original(chain, max_blocks)
        for g, (ids, window) in enumerate(zip(out, self.windows, strict=True)):
            if window is None:
                continue
            for d, bid in enumerate(ids):
                older = d - shift
                if bid != NULL_BLOCK and older >= 0:
                    found = self.lookup_group(chain, older, g)
                    if found is not None and found not in ids:
                        ids[d] = found
        return out

    plant(engine, "cache.hit_tables", hit_tables)


def _mutant(name: str, bug: str, apply, needs=_not_hybrid) -> Mutant:
    return Mutant(name, bug, "layer_group", apply, suites=SUITES, not_applicable_on=needs)


LAYER_GROUP_MUTANTS = (
    _mutant(
        "window_off_by_one",
        "the window trim keeps one key too few",
        window_off_by_one,
        _no_window,
    ),
    _mutant(
        "freed_inside_window",
        "a window group gives back a block its window still reaches",
        freed_inside_window,
        _no_window,
    ),
    _mutant(
        "global_reads_local_table",
        "a global layer reads a sliding-window group's block table",
        global_reads_local_table,
    ),
    _mutant(
        "hit_reuses_blocks_outside_window",
        "a prefix hit reuses a window group's blocks from outside the window",
        hit_reuses_blocks_outside_window,
    ),
)
