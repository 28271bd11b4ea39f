"""The native LoRA delta of a mixed batch (native/lora_delta.cpp): each adapter row times its
own adapter's factors only, one call per projection, built at first use like the model's
kernels (kvpage.model.native_build); float32 on CPU. Where it is not built (no compiler,
KVPAGE_NATIVE=0) or the tables are not float32 on CPU, kvpage.lora.apply's stacked-table path
runs instead."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

import kvpage.model.native_build as native_build

SOURCE = Path(native_build.__file__).parent / "native" / "lora_delta.cpp"


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native_build.load(SOURCE, "the LoRA delta", _bind)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvpage_lora_delta.restype = None
    lib.kvpage_lora_delta.argtypes = [i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ptr]
    lib.kvpage_lora_delta.argtypes += [ptr, ptr]
    return lib


def available() -> bool:
    return _library() is not None


@dataclass(slots=True)
class DeltaRows:
    """A pass's adapter rows grouped by slot, as the kernel reads them, and its scratch."""

    num_rows: int  # the pass's rows
    rows: torch.Tensor  # (m,) int64: the batch rows that run with an adapter
    slots: torch.Tensor  # (m,) int64: each one's slot
    scratch: torch.Tensor  # (m, max_rank) float32: x A^T of each row


def delta_rows(slot_rows, num_rows: int, max_rank: int) -> DeltaRows:
    """`slot_rows`: (slot, its rows (n,) long, or None: every row) -> DeltaRows."""
    rows, slots = [], []
    for slot, own in slot_rows:
        own = torch.arange(num_rows) if own is None else own.to(torch.int64)
        rows.append(own)
        slots.append(torch.full_like(own, slot))
    rows_t = torch.cat(rows).contiguous()
    if len(rows_t) and not 0 <= int(rows_t.min()) <= int(rows_t.max()) < num_rows:
        raise ValueError(f"adapter rows outside the pass's {num_rows} rows")
    scratch = torch.empty(len(rows_t), max_rank)
    return DeltaRows(num_rows, rows_t, torch.cat(slots).contiguous(), scratch)


def add_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    a_rows: torch.Tensor,
    b_rows: torch.Tensor,
    ranks: torch.Tensor,
    step: DeltaRows,
) -> None:
    """y += each adapter row's x A_s^T B_s^T, in place. x (N, in), y (N, out) float32 rows of
    unit stride (y may be a view of a fused output); a_rows (L R, in), b_rows (L R, out), ranks
    (L,) int64 of this projection's slot tables (kvpage.lora.tables)."""
    n, fan_in = x.shape
    fan_out = y.shape[1]
    max_rank = step.scratch.shape[1]
    if n != step.num_rows or y.shape[0] != n:
        raise ValueError(f"the step's rows are {step.num_rows}, x has {n}, y {y.shape[0]}")
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError(f"the LoRA delta takes unit-stride rows: x {x.stride()}, y {y.stride()}")
    if (
        a_rows.shape[1] != fan_in
        or b_rows.shape[1] != fan_out
        or len(ranks) * max_rank != len(a_rows)
    ):
        raise ValueError(
            f"tables {tuple(a_rows.shape)} / {tuple(b_rows.shape)} for x {tuple(x.shape)} -> y {tuple(y.shape)}"
        )
    _library().kvpage_lora_delta(
        len(step.rows), fan_in, fan_out,
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
        a_rows.data_ptr(), b_rows.data_ptr(), max_rank,
        step.rows.data_ptr(), step.slots.data_ptr(), ranks.data_ptr(), step.scratch.data_ptr(),
    )  # fmt: skip
