"""Block operations: what the KV tensors must do for the cache's bookkeeping to hold, as plain data.

The cache manager and the scheduler decide; they never touch a tensor. Each decision that moves KV
is recorded as one operation, and a step's operations travel in its plan (kvpage.engine.plan) to
the executor, which applies them in order before the forward pass (under tensor parallelism, on
every rank). Order matters: a swap-out reads its blocks before a later allocation in the same step
may reuse them; a copy reads its source before a later free may invalidate it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CopyBlock:
    """Copy-on-write: `dst` (freshly allocated) gets the KV of `src`, a shared partial block."""

    src: int
    dst: int
    seq_id: int  # the writer whose table now names dst
    logical_block: int


@dataclass(frozen=True, slots=True)
class InvalidateBlock:
    """The block went FREE: what its generation held beside the KV (a quantized layout's
    scales) must go before a new owner writes it."""

    block_id: int


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Copy the sequence's blocks (logical order) to the swap space. The blocks are already
    given back in the metadata; their KV is read before anything later writes them."""

    seq_id: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Write the sequence's saved KV into `block_ids` (allocated RESTORING: unreadable until
    the scheduler sees the copy done)."""

    seq_id: int
    block_ids: tuple[int, ...]


BlockOp = CopyBlock | InvalidateBlock | SwapOut | SwapIn
