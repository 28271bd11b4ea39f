"""The low-rank products of one step's mixed batch, computed over the stacked slot tables
(kvpage.lora.tables): per projection, t = x @ A^T of every slot, masked so each row keeps only
its own adapter's columns, then y += t @ (scale B^T of every slot). Two oneDNN calls per
projection for any mix of adapters and the base model: no loop over rows, none over adapters.
A float32 model on CPU takes the native delta instead (kvpage.lora.native_delta: one call, each
row times its own adapter's factors only).

The delta is added in place through native_build.call, reading the step's mask and the tables
when it runs: a decode tape (kvpage.model.decode_tape) records it as one call and replays it on
later steps with their own mix of adapters, and with the tables as the slots hold them then (a
tape's own copies would go stale when an adapter is loaded). The mask is therefore built when
the step's rows are set (`use_rows` with the row count), not by the first projection."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvpage.lora import native_delta
from kvpage.lora.native_delta import DeltaRows
from kvpage.lora.slots import ResidentAdapter
from kvpage.lora.tables import SlotTables
from kvpage.model import native_build

SlotRows = list[tuple[int, torch.Tensor | None]]  # (slot, its rows (n,) long; None: every row)


@dataclass(slots=True)
class AdapterRows:
    adapter: ResidentAdapter
    rows: torch.Tensor | None  # (n,) long, or None: every row of the batch


@dataclass(slots=True)
class LoraBatch:
    groups: list[AdapterRows]
    num_rows: int | None = None  # the pass's rows; None: the mask waits for the first projection


@dataclass(slots=True)
class StepRows:
    """What a forward pass needs of its batch's adapters: the slots and their rows, and the
    rows grouped by slot for the native delta or the row mask for the stacked tables' products
    (built with the rows when their count is given, else at the first projection)."""

    slot_rows: SlotRows
    mask: torch.Tensor | None = None
    native: DeltaRows | None = None  # the rows as the native delta reads them, where it runs


class LoraContext:
    """Shared by every layer of a model served with adapters; `batch` is set for one forward
    pass (None: base model only). It is per thread: the server's shadow checker runs the same
    model on the base weights in its own thread while the engine's step has a batch set.

    `inside`: projections whose delta their own projection adds (`delta`), not the layer after
    it (`apply`): under tensor parallelism a row-parallel rank's partial delta must join the
    all-reduce with its partial product."""

    def __init__(self, tables: SlotTables, inside: frozenset[str] = frozenset()) -> None:
        self.tables, self.inside = tables, inside
        self._local = threading.local()

    @property
    def batch(self) -> StepRows | None:
        return getattr(self._local, "batch", None)

    @batch.setter
    def batch(self, batch: LoraBatch | None) -> None:
        rows = None if batch is None else [(g.adapter.slot, g.rows) for g in batch.groups]
        self.use_rows(rows, None if batch is None else batch.num_rows)

    def use_rows(self, slot_rows: SlotRows | None, num_rows: int | None = None) -> None:
        if slot_rows is None:
            self._local.batch = None
            return
        step = StepRows(slot_rows)
        if num_rows is not None:
            self._index(step, num_rows)
        self._local.batch = step

    def _index(self, step: StepRows, num_rows: int) -> None:
        if self.tables.native_runs:
            step.native = native_delta.delta_rows(step.slot_rows, num_rows, self.tables.max_rank)
        else:
            step.mask = self.tables.row_mask(step.slot_rows, num_rows)

    @property
    def replayable(self) -> bool:
        """Whether a decode tape may record this pass's deltas: its rows are indexed already (a
        replay runs no projection that could index them)."""
        step = self.batch
        return step is not None and (step.mask is not None or step.native is not None)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = base(x) for the batch's rows -> y plus each row's adapter delta."""
        return y if module in self.inside else self.delta(layer, module, x, y)

    def delta(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter delta: a new tensor, or y itself with the delta added in
        place while a decode tape records (the recorded call then adds it on every replay)."""
        if self.batch is None:
            return y
        if native_build.is_recording():
            native_build.call(self.add_delta, layer, module, x, y)
            return y
        out = self.with_delta(layer, module, x, y)
        return y if out is None else out

    def add_delta(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the delta, from the tables and the step's rows as they are when it runs."""
        native = self._native(layer, module, x, y)
        if native is not None:
            native_delta.add_delta(x, y, *native, self.batch.native)
            return
        out = self.with_delta(layer, module, x, y)
        if out is not None:
            y.copy_(out)

    def _native(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor):
        """This projection's native tables where the native delta takes x and y, else None."""
        native = self.tables.native.get((layer, module))
        step = self.batch
        if native is None or step is None or x.dtype is not torch.float32:
            return None
        if y.dtype is not torch.float32 or x.stride(-1) != 1 or y.stride(-1) != 1 or x.dim() != 2:
            return None
        if step.native is None:
            step.native = native_delta.delta_rows(step.slot_rows, x.shape[0], self.tables.max_rank)
        return native

    def with_delta(
        self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor | None:
        """y plus every row's adapter delta for (layer, module), a new tensor; None where no
        row has an adapter or no resident adapter targets this projection."""
        step = self.batch
        tables = self.tables.stacks.get((layer, module))
        if step is None or tables is None:
            return None
        native = self._native(layer, module, x, y)
        if native is not None:
            out = y.clone(memory_format=torch.contiguous_format)
            native_delta.add_delta(x, out, *native, step.native)
            return out
        if step.mask is None:
            step.mask = self.tables.row_mask(step.slot_rows, x.shape[0])
        packed = self.tables.packed.get((layer, module))
        if packed is not None and x.dtype == self.tables.dtype and x.is_cpu:
            a_packed, b_packed = packed
            # (x A^T) * mask as one oneDNN call (its binary post-op), then y + t B^T as another
            t = torch.ops.mkldnn._linear_pointwise.binary(x, step.mask, a_packed, None, "mul")
            return torch.ops.mkldnn._linear_pointwise.binary(t, y, b_packed, None, "add")
        a_stack, b_stack = tables
        if x.dtype != a_stack.dtype:  # a 16-bit model: the delta in float32, one rounding
            t = (x.to(a_stack.dtype) @ a_stack) * step.mask
            return torch.addmm(y.to(a_stack.dtype), t, b_stack).to(y.dtype)
        return torch.addmm(y, (x @ a_stack) * step.mask, b_stack)


def attach(model, context: LoraContext) -> None:
    """Route every layer's projections through `context` (Llama-shaped layers)."""
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.lora = context
        layer.mlp.lora, layer.mlp.layer = context, index
