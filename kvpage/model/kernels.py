"""Which kernels a forward pass may bind: the engine's fast paths (kvpage's native kernels, the
one-call decode step, oneDNN's prepacked weights, the widened int8/bfloat16 tiles), or torch's
plain operators only.

Why: the verifier's contiguous reference runs the same model code as the engine, so a bug in a
fast path taken by both sides would be identical on both and prove nothing. Inside
`torch_kernels()` every dispatch point of kvpage.model takes its plain torch branch (F.linear,
the torch norm, rotary and activation): the reference shares the weights and the model math
(which the gate checks against transformers on its own), never a kernel. `fast_paths_off(path)`
turns off one path alone: the gate re-runs a diverging case so, and a case that then passes
names the path (the `kernel` class). The switch is per thread, so a server's shadow re-check
does not turn the fast paths off for the engine thread beside it.

The engine's steps read one attribute of a thread-local per dispatch (`all_allowed`); the
per-path choice is made only while some path is off."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Each fast path by the name the gate's reports give it.
FAST_PATHS = (
    "decode_plan",  # kvpage.model.decode_plan and its one native call (native_decode_step)
    "gemv",  # kvpage.model.native_gemv: the weight GEMV at a few rows (int8 ones too)
    "amx",  # kvpage.model.native_amx: bfloat16 at 3-32 rows on AMX tiles
    "onednn",  # oneDNN's prepacked weights (kvpage.model.projection)
    "widened",  # kvpage.model.widened: int8 and bfloat16 weights widened a tile at a time
    "small_ops",  # kvpage.model.native_small_ops: RMSNorm, rotary, silu * up
    "paged_decode",  # kvpage.model.native_attention: the paged decode attention kernel
)

_state = threading.local()


def all_allowed() -> bool:
    """No path off on this thread (the engine's normal state)."""
    return not getattr(_state, "off", None)


def allowed(path: str) -> bool:
    off = getattr(_state, "off", None)
    return not off or path not in off


@contextmanager
def fast_paths_off(*paths: str) -> Iterator[None]:
    """`paths` (FAST_PATHS) off for the duration, on this thread; nests. The decode plan runs
    only with every path on: it binds its kernels once."""
    unknown = set(paths) - set(FAST_PATHS)
    if unknown:
        raise ValueError(f"unknown fast paths {sorted(unknown)}; known: {FAST_PATHS}")
    outer = getattr(_state, "off", None)
    _state.off = frozenset((*(outer or ()), *paths))
    try:
        yield
    finally:
        _state.off = outer


def torch_kernels():
    """Torch's own operators only, for the duration (every fast path off)."""
    return fast_paths_off(*FAST_PATHS)
