"""Which kernels a forward pass may bind: the engine's fast paths (kvpage's native kernels, the
one-call decode step, oneDNN's prepacked weights, the widened int8/bfloat16 tiles), or torch's
plain operators only.

Why: the verifier's contiguous reference runs the same model code as the engine, so a bug in a
fast path taken by both sides would be identical on both and prove nothing. Inside
`torch_kernels()` every dispatch point of kvpage.model takes its plain torch branch (F.linear,
the torch norm, rotary and activation): the reference shares the weights and the model math
(which the gate checks against transformers on its own), never a kernel. The switch is
per thread, so a server's shadow re-check does not turn the fast paths off for the engine
thread beside it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_state = threading.local()


def native_allowed() -> bool:
    """False inside `torch_kernels()` on this thread."""
    return not getattr(_state, "torch_only", False)


@contextmanager
def torch_kernels() -> Iterator[None]:
    """Torch's own operators only, for the duration (nests; restores the outer setting)."""
    outer = getattr(_state, "torch_only", False)
    _state.torch_only = True
    try:
        yield
    finally:
        _state.torch_only = outer
