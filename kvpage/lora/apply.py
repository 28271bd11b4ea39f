"""The low-rank products of one step's mixed batch: rows grouped by adapter, each group's
x @ A^T @ (scale B^T) added to the base projection's output. One gather and two small matmuls
per adapter group and projection: no loop over rows."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvpage.lora.slots import ResidentAdapter


@dataclass(slots=True)
class AdapterRows:
    adapter: ResidentAdapter
    rows: torch.Tensor | None  # (n,) long, or None: every row of the batch


@dataclass(slots=True)
class LoraBatch:
    groups: list[AdapterRows]


class LoraContext:
    """Shared by every layer of a model served with adapters; `batch` is set for one forward
    pass (None: base model only). It is per thread: the server's shadow checker runs the same
    model on the base weights in its own thread while the engine's step has a batch set."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def batch(self) -> LoraBatch | None:
        return getattr(self._local, "batch", None)

    @batch.setter
    def batch(self, batch: LoraBatch | None) -> None:
        self._local.batch = batch

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = base(x) for the batch's rows -> y plus each adapter group's delta."""
        if self.batch is None:
            return y
        for group in self.batch.groups:
            factors = group.adapter.factors.get((layer, module))
            if factors is None:
                continue  # this adapter does not target this projection
            a_t, b_t = factors
            if group.rows is None:
                y = y + (x @ a_t) @ b_t
            else:
                y = y.index_add(0, group.rows, (x[group.rows] @ a_t) @ b_t)
        return y


def attach(model, context: LoraContext) -> None:
    """Route every layer's projections through `context` (Llama-shaped layers)."""
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.lora = context
        layer.mlp.lora, layer.mlp.layer = context, index
