"""Prefill chunks of one shape, batched: a step's chunks with the same number of new tokens T
after the same number of cached keys attend in one SDPA call a layer (and, with a cached prefix,
one gather of their contexts), not one call each. A shared-prefix step holds dozens of such
chunks: 32 requests x 12 layers made 384 SDPA calls and 384 gathers where 12 of each do.

Batching changes no arithmetic: each chunk's rows still attend to exactly its own keys, with the
causal mask that is the same for every chunk of the shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpage.model.paged_attention import PrefillChunk


@dataclass(slots=True)
class PrefillGroup:
    rows: slice | torch.Tensor  # the count * T rows of the packed batch, chunk after chunk
    count: int
    context_slots: torch.Tensor | None  # (count * S,) the chunks' contexts end to end; None:
    # fresh prompts, each attending to its own new K/V

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """(count * L, ...) rows -> (count, L, ...): a view, whatever the row stride."""
        return x.view(self.count, -1, *x.shape[1:])


def group_prefills(chunks: list[PrefillChunk], device: torch.device) -> list[PrefillGroup]:
    """The chunks by shape, in order of first appearance."""
    by_shape: dict[tuple[int, int], list[PrefillChunk]] = {}
    for chunk in chunks:
        cached = -1 if chunk.context_slots is None else chunk.context_slots.numel()
        by_shape.setdefault((chunk.token_end - chunk.token_start, cached), []).append(chunk)
    return [_group(members, device) for members in by_shape.values()]


def _group(members: list[PrefillChunk], device: torch.device) -> PrefillGroup:
    first = members[0]
    if len(members) == 1:
        return PrefillGroup(slice(first.token_start, first.token_end), 1, first.context_slots)
    adjacent = all(a.token_end == b.token_start for a, b in zip(members, members[1:], strict=False))
    if adjacent:  # the usual case: a view of the batch, no row gather or scatter
        rows: slice | torch.Tensor = slice(first.token_start, members[-1].token_end)
    else:
        spans = [torch.arange(c.token_start, c.token_end, device=device) for c in members]
        rows = torch.cat(spans)
    slots = None
    if first.context_slots is not None:
        slots = torch.cat([c.context_slots for c in members])
    return PrefillGroup(rows, len(members), slots)
