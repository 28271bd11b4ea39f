"""The quantized contiguous reference's K/V round trip: what a paged engine with
`kv_cache_dtype` must attend to, written here again from the format's definition rather than
imported from the engine's quantiser, so a bug in the engine's quantiser (rounding, scale
granularity) shows up as a divergence instead of being shared by both sides.

The definition (the same as kvpage.kv.format's docstring states):
  per token and kv-head, over head_dim: scale = float16(clamp(max|x| / qmax, 2^-14, 65504));
  int8: code = clamp(round-half-even(x / scale), -127, 127);
  fp8_e4m3: code = float8_e4m3fn(clamp(x / scale, -448, 448)) (the cast rounds half to even);
  x' = float32(code) * float32(scale), then the model dtype.
  bfloat16: x' = x cast to bfloat16 and back. auto: x' = x.
Every token is rounded when it is written and read back as rounded -- the prompt's own tokens in
the step that computes them included -- so the reference attends to x' everywhere, as the
engine does."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpage.model.attention import ContiguousKVCache

# kv_cache_dtype -> (code dtype, largest code); bfloat16 and auto have no codes
_CODES = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}
_LAYOUTS = {"auto": 1, "bfloat16": 1, "int8": 2, "fp8_e4m3": 2}


@dataclass(frozen=True, slots=True)
class RoundTrip:
    """The quantise -> dequantise the reference applies to every K/V vector it stores."""

    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in _LAYOUTS:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype in _CODES

    @property
    def layout_version(self) -> int:
        return _LAYOUTS[self.kv_cache_dtype]

    def kv_dtype(self, model_dtype: torch.dtype) -> str:
        """The stored dtype's name (what the engine's namespace and trace call kv_dtype)."""
        if self.kv_cache_dtype == "auto":
            stored = model_dtype
        elif self.kv_cache_dtype == "bfloat16":
            stored = torch.bfloat16
        else:
            stored = _CODES[self.kv_cache_dtype][0]
        return str(stored).removeprefix("torch.")

    def apply(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: (T, KVH, D) -> (x' in x's dtype, float16 scales (T, KVH) or None)."""
        if self.kv_cache_dtype == "auto":
            return x, None
        if self.kv_cache_dtype == "bfloat16":
            return x.to(torch.bfloat16).to(x.dtype), None
        code_dtype, qmax = _CODES[self.kv_cache_dtype]
        x32 = x.to(torch.float32)
        per_vector_max = torch.amax(torch.abs(x32), dim=2)  # (T, KVH)
        scale16 = torch.clamp(per_vector_max / qmax, min=2.0**-14, max=65504.0).half()
        scale = scale16.to(torch.float32)[:, :, None]  # (T, KVH, 1)
        ratio = x32 / scale
        if code_dtype is torch.int8:
            codes = torch.clamp(torch.round(ratio), -qmax, qmax).to(torch.int8)
        else:
            codes = torch.clamp(ratio, -qmax, qmax).to(code_dtype)
        return (codes.to(torch.float32) * scale).to(x.dtype), scale16


class RoundTripKVCache(ContiguousKVCache):
    """The contiguous cache of one request, storing K/V after the round trip; it keeps the
    float16 scales it made, by layer, so a trace can say which scales the reference read."""

    def __init__(self, num_layers: int, round_trip: RoundTrip) -> None:
        super().__init__(num_layers)
        self.round_trip = round_trip
        self.scales: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # (T, 2, KVH)

    def attend(self, layer: int, q, k, v, scale: float, window: int | None = None) -> torch.Tensor:
        k, k_scales = self.round_trip.apply(k)
        v, v_scales = self.round_trip.apply(v)
        if k_scales is not None:
            self.scales[layer].append(torch.stack((k_scales, v_scales), dim=1))
        return super().attend(layer, q, k, v, scale, window)

    def scales_of(self, start: int, end: int) -> torch.Tensor | None:
        """Scales of tokens [start, end) as (L, 2, end - start, KVH), or None (no scales)."""
        if not self.round_trip.quantized:
            return None
        per_layer = [torch.cat(chunks)[start:end] for chunks in self.scales]  # (n, 2, KVH) each
        return torch.stack(per_layer).transpose(1, 2)
