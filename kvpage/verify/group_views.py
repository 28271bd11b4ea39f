"""Per-layer-group views against the reference (kvpage.cache.groups): which table each layer read,
and whether each window group held exactly the blocks its window needs at the step.

The reference keeps every key of every layer in one contiguous cache and masks each layer's
window itself; what it records is each layer's window, from its own config. From that and the
step's first query position (the engine's record: a chunk or a hit starts where the engine says)
the blocks a layer needs are [max(0, q - W + 1) // B, n) for a window W, [0, n) for a global
layer, with n the step's blocks. A group view that lacks one of them had a block freed while
the window still reached it; one holding a block below them took (or kept) a block outside its
window; a block whose index key is for another position holds another position's KV (a hit
that took it from outside the window); a layer listed under a group of another window reads
another kind's table. Each is a
`layer_group` divergence naming the group and its first layer, found at the step it first
happens (before any token need differ: a block held outside the window changes no token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpage.reference.records import GroupView, StepRecord


@dataclass(frozen=True, slots=True)
class GroupMismatch:
    group: int
    first_layer: int
    reason: str
    fields: dict[str, Any]


def group_mismatch(ref: StepRecord, cand: StepRecord) -> GroupMismatch | None:
    """The first group (in group order) whose view differs from what the reference implies."""
    groups, windows = cand.view.groups, ref.view.layer_windows
    if not groups or not windows:
        return None
    entries, bs = cand.view.entries, cand.view.block_size
    n = entries[-1].logical + 1 if entries else 0  # a window group 0 holds no leading NULLs
    in_extra = {layer for g in groups for layer in g.layers}
    global_layers = [layer for layer in range(len(windows)) if layer not in in_extra]
    wrong = [layer for layer in global_layers if windows[layer] is not None]
    if wrong:  # a window layer reads group 0's table (global: the whole prefix)
        return _mismatch(None, wrong[0], windows, n, bs, "a window layer reads the global table")
    for g in groups:
        found = _check_group(g, windows, n, bs)
        if found is not None:
            return found
    return None


def _check_group(g: GroupView, windows, n: int, bs: int) -> GroupMismatch | None:
    for layer in g.layers:
        if windows[layer] != g.window:
            own = "global" if windows[layer] is None else f"window {windows[layer]}"
            kind = "global" if g.window is None else f"window-{g.window}"
            return _mismatch(g, layer, windows, n, bs, f"a {own} layer reads a {kind} table")
    if not g.layers:
        return None
    first = g.layers[0]
    need = _needed(windows[first], g.query_start, n, bs)
    held = [e.logical for e in g.entries]
    moved = [(e.logical, at) for e, at in zip(g.entries, g.published_at, strict=False) if at >= 0]
    moved = [(logical, at) for logical, at in moved if logical != at]
    if moved:
        logical, at = moved[0]
        reason = f"block {logical} reads a block published for block {at}"
        return _mismatch(g, first, windows, n, bs, reason)
    if held == need:
        return None
    if set(need) - set(held):
        reason = "a block inside the window was given back"
    else:
        reason = "holds blocks outside its window"
    return _mismatch(g, first, windows, n, bs, reason)


def _needed(window: int | None, query_start: int, n: int, bs: int) -> list[int]:
    lo = 0 if window is None else max(0, query_start - window + 1) // bs
    return list(range(lo, n))


def _mismatch(g: GroupView | None, layer: int, windows, n: int, bs: int, reason: str):
    group = 0 if g is None else g.group
    window = None if g is None else g.window
    query_start = 0 if g is None else g.query_start
    entries = () if g is None else g.entries
    ref_window = windows[layer]
    fields = {
        "group": group,
        "first_layer": layer,
        "window": window,
        "window_ref": ref_window,
        "window_start": 0 if g is None else g.window_start,
        "window_start_ref": 0 if ref_window is None else max(0, query_start - ref_window + 1),
        "needed_blocks": _needed(ref_window, query_start, n, bs),
        "held_blocks": [e.logical for e in entries],
        "block_ids": [e.physical for e in entries],
        "generations": [e.generation for e in entries],
    }
    return GroupMismatch(group, layer, f"group {group}, layer {layer}: {reason}", fields)
