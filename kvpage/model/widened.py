"""y = x @ (W * scale)^T + bias computed in float32 on the weight widened a tile of output channels
at a time: the linear layer for many rows of x where no kernel runs the weight's own dtype fast.

Why: at prefill sizes a linear layer is bound by arithmetic, not by reading the weight, and the
float32 GEMM is the fastest one torch has on CPUs without AVX-512 (bench/int8_weights.py
--kernel-sweep; an AVX2 EPYC, 2048 rows of 768: torch's bfloat16 GEMM 8.4x slower, its int8
kernel ~30x slower with float32 x, kvpage's weight kernel, which re-reads x for every few weight
rows, 2x slower). Widening costs one pass over the weight per call, small beside M x K x N
multiply-adds once M is in the dozens. The widened copy is one tile of at most TILE_BYTES
(it stays in cache for the GEMM that reads it), never the whole matrix: an int8 or bfloat16
model keeps its memory footprint.

Numerics: float32 products of exactly widened values (bfloat16 and int8 codes are exact in
float32; an int8 weight is code * scale rounded once to float32, as the reference's
dequantisation does), float32 accumulation, the bias added in float32, one rounding to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_BYTES = 4 << 20  # float32 bytes of weight widened at once


def widened_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (..., K) @ widen(weight (N, K))^T [* scales (N,)] [+ bias (N,)] -> (..., N), x's dtype."""
    x32 = x.to(torch.float32)
    rows = max(1, TILE_BYTES // (4 * weight.shape[1]))
    parts = [
        F.linear(x32, _widen(weight[start : start + rows], scales, start))
        for start in range(0, weight.shape[0], rows)
    ]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(x.dtype)


def _widen(tile: torch.Tensor, scales: torch.Tensor | None, start: int) -> torch.Tensor:
    w32 = tile.to(torch.float32)  # a float32 tile is the weight itself: never scaled in place
    if scales is None:
        return w32
    return w32 * scales[start : start + tile.shape[0], None].to(torch.float32)
