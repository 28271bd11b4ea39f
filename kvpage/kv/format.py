"""How K/V are stored in the paged pool: the format `kv_cache_dtype` names, and the engine's
quantiser for it.

Formats:
- "auto": the model dtype, stored as computed (bit-exact with an unquantized engine). Layout 1.
- "bfloat16": a plain cast on write, widened back to the model dtype on read. Layout 1.
- "int8": symmetric, round-to-nearest-even, codes in [-127, 127]. Layout 2.
- "fp8_e4m3": `torch.float8_e4m3fn` codes (cast rounds to nearest even), range +-448. Layout 2.

Layout 2 = codes (L, 2, NB, B, KVH, D) plus one float16 scale per (block, layer, K/V, kv-head,
token): scales (L, 2, NB, B, KVH), beside the block in the pool. Why one scale per token rather
than one per block: a token's codes and scale are fixed when it is written and never change, so
what a block holds does not depend on how its tokens arrived (one prefill, chunks, decode steps,
a recompute after preemption). A per-block scale would have to re-quantise the partial last block
on every append, and the result would then depend on the chunking -- the paged engine could no
longer equal the contiguous reference exactly. Float16 scales keep the overhead at 2 bytes per
token and head (int8 at head_dim 16: 18 bytes against 64 in float32, 3.56x).

scale = fp16(clamp(amax(|x|) / qmax, 2^-14, 65504)); code = clamp(round(x / scale), +-qmax);
x' = float32(code) * float32(scale). Every step is elementwise or a max, so the result does not
depend on batch shape. The contiguous reference implements the same round trip independently
(kvpage.reference.kv_oracle)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpage.config import KV_CACHE_DTYPES
from kvpage.errors import InvalidConfig

SCALE_DTYPE = torch.float16
SCALE_MIN = 2.0**-14  # smallest normal float16: an all-zero vector still gets a finite scale
SCALE_MAX = 65504.0  # largest float16
PLAIN_LAYOUT = 1  # (L, 2, NB, B, KVH, D) in the stored dtype
SCALED_LAYOUT = 2  # codes as above + scales (L, 2, NB, B, KVH), one per token and kv-head

_QUANTIZED = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}


@dataclass(frozen=True, slots=True)
class KVFormat:
    kv_cache_dtype: str  # what the user asked for
    storage_dtype: torch.dtype  # what a pool element is
    compute_dtype: torch.dtype  # what attention reads (the model dtype)
    qmax: float | None  # None: no scales (a plain cast)

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    @property
    def name(self) -> str:
        """The stored dtype: the namespace's kv_dtype and the trace's."""
        return str(self.storage_dtype).removeprefix("torch.")

    @property
    def layout_version(self) -> int:
        return SCALED_LAYOUT if self.quantized else PLAIN_LAYOUT

    @property
    def cast_only(self) -> bool:
        """Stored in another float dtype without scales (bfloat16 KV under a float32 model)."""
        return not self.quantized and self.storage_dtype != self.compute_dtype

    def describe(self) -> str:
        if self.quantized:
            return f"{self.name} codes + float16 scale per (block, layer, K/V, kv-head, token)"
        return f"{self.name} values, no scales"


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidConfig(
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype == "auto":
        return KVFormat(kv_cache_dtype, model_dtype, model_dtype, None)
    if kv_cache_dtype == "bfloat16":
        return KVFormat(kv_cache_dtype, torch.bfloat16, model_dtype, None)
    storage, qmax = _QUANTIZED[kv_cache_dtype]
    return KVFormat(kv_cache_dtype, storage, model_dtype, qmax)


def quantize(
    x: torch.Tensor, fmt: KVFormat, rounding: Callable[[torch.Tensor], torch.Tensor] = torch.round
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (N, KVH, D) -> codes (N, KVH, D) in fmt.storage_dtype, scales (N, KVH) float16."""
    amax = x.float().abs().amax(dim=-1)  # (N, KVH)
    scales = (amax / fmt.qmax).clamp(SCALE_MIN, SCALE_MAX).to(SCALE_DTYPE)
    y = x.float() / scales.float().unsqueeze(-1)
    if fmt.storage_dtype == torch.int8:
        codes = rounding(y).clamp(-fmt.qmax, fmt.qmax).to(torch.int8)
    else:  # the float8 cast rounds to nearest even; clamp first, it does not saturate
        codes = y.clamp(-fmt.qmax, fmt.qmax).to(fmt.storage_dtype)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., D), scales (...) -> values (..., D) in `dtype`."""
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)
