"""Which of the engine's fast paths a gate run took, and which this machine has: the report says
so per cell, so a path never taken (and so never checked against the torch-only reference) is
visible. Counted by wrapping each path's entry point for the duration of the gate run in this
process (a cell runs in a process of its own); nothing is counted, and nothing costs, in
serving. A replayed decode tape runs its recorded kernel calls directly: its steps count as
decode_plan.one_call, not as the kernels'."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import kvpage.model.decode_tape as decode_tape
import kvpage.model.native_attention as native_attention
import kvpage.model.native_small_ops as native_small_ops
from kvpage.model.kernels import FAST_PATHS
from kvpage.model.linear_kernels import LINEAR_KERNELS

# (owner, attribute, the name counted); the linear kernels' from their table
ENTRY_POINTS = (
    *((*k.counted, k.path) for k in LINEAR_KERNELS),
    (native_small_ops, "rms_norm", "small_ops"),
    (native_small_ops, "silu_mul", "small_ops"),
    (native_small_ops, "rotary_", "small_ops"),
    (native_small_ops, "gelu_tanh_mul", "small_ops"),
    (native_small_ops, "layer_norm", "small_ops"),
    (native_small_ops, "gelu_new", "small_ops"),
    (native_attention.PagedDecode, "__call__", "paged_decode"),
    (decode_tape.DecodeTape, "run", "decode_plan"),
    (decode_tape.Tape, "replay", "decode_plan.one_call"),
)


def available() -> dict[str, bool]:
    """Each path: whether it can run on this machine (its kernel built, its instructions)."""
    small_ops = native_small_ops.available()
    return {
        "decode_plan": small_ops and native_attention.available(),
        **{k.path: k.available() for k in LINEAR_KERNELS},
        "small_ops": small_ops,
        "paged_decode": native_attention.available(),
    }


@contextmanager
def counting() -> Iterator[Counter]:
    """Calls of each entry point, by path name, while the block runs."""
    counts: Counter = Counter()
    with ExitStack() as stack:
        for owner, name, path in ENTRY_POINTS:
            original = getattr(owner, name)
            setattr(owner, name, _counted(original, path, counts))
            stack.callback(setattr, owner, name, original)
        yield counts


def _counted(original, path: str, counts: Counter):
    def call(*args, **kwargs):
        counts[path] += 1
        return original(*args, **kwargs)

    return call


def summary(counts: Counter) -> dict[str, dict]:
    """{path: {"available": bool, "calls": n}} for every fast path, plus the one-call step."""
    have = available()
    paths = {p: {"available": have[p], "calls": counts.get(p, 0)} for p in FAST_PATHS}
    paths["decode_plan.one_call"] = {
        "available": have["decode_plan"],
        "calls": counts.get("decode_plan.one_call", 0),
    }
    return paths
