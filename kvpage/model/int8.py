"""Weight-only int8: the format and the engine's fused matmul.

The format, per output channel (row) o of a (out, in) weight W:
  scale_o = max_i |W[o, i]| / 127, computed in float32, then rounded *up* to the model dtype
            (the kernel takes its scales in the activation dtype); at least the dtype's smallest
            subnormal (a zero row), subnormals allowed (float16's normals end at 6.1e-5, the
            scale of a row whose largest weight is 0.0078);
  code[o, i] = clamp(round-half-even(W[o, i] / scale_o), -127, 127), int8;
  W'[o, i] = code[o, i] * scale_o.
Rounding the scale up keeps |W / scale| <= 127, so no code clamps and every weight is within
scale_o / 2 of W' (the round-trip bound tests/model/test_int8_weights.py checks per channel).

Why per output channel: the scale then multiplies whole output features, so y = (x @ code^T) *
scale — the dequantisation is one multiply after the integer-weight matmul, fused in the kernel
(kvpage's own, kvpage.model.native_gemv) for decode-sized row counts. Above them (prefill), or
where that kernel is not built, Projection widens the codes one tile of output channels at a
time for torch's float32 GEMM (kvpage.model.widened): never the whole matrix in float. It also
shards cleanly: a column-parallel rank keeps its rows' scales, a row-parallel rank keeps every
scale and the all-reduce sums (x_r @ code_r^T) * scale over ranks = (x @ code^T) * scale.

torch's kernel (torch 2.13, CPU): x (M, K) 2-D and contiguous in K, in float32, bfloat16 or
float16; codes (N, K) int8; scales (N,) in x's dtype exactly (a float32 scale with a bfloat16 x
is refused). `check_supported` probes it on the dtype and device a model is loaded in, and raises
UnsupportedQuantization where it does not run; there is no silent float fallback. kvpage's
kernel takes the same codes and scales (float32 and bfloat16 x); Projection uses neither torch
kernel: torch's is several times slower at one row, ~27x at 16 rows of float32 x, and for
bfloat16 x with K % 16 != 0 returns wrong values or crashes. Int8Linear.forward, outside
Projection, keeps it."""

from __future__ import annotations

import torch
from torch import nn

from kvpage.errors import UnsupportedQuantization

QMAX = 127


def quantize_per_channel(
    weight: torch.Tensor, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> (codes (out, in) int8, scales (out,) in scale_dtype)."""
    w32 = weight.detach().to(torch.float32)
    exact = torch.amax(w32.abs(), dim=1) / QMAX  # (out,)
    exact = torch.clamp(exact, min=smallest_subnormal(scale_dtype))
    scales = _round_up(exact, scale_dtype)
    codes = torch.round(w32 / scales.to(torch.float32)[:, None])
    return torch.clamp(codes, -QMAX, QMAX).to(torch.int8), scales


def smallest_subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.tiny * info.eps  # 2^-24 for float16, 2^-133 bfloat16, 2^-149 float32


def _round_up(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest value of `dtype` >= each of x32 (a cast alone may round down)."""
    rounded = x32.to(dtype)
    low = rounded.to(torch.float32) < x32
    return torch.where(low, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)), rounded)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ (codes * scales)^T -> (..., N), the dequantisation fused in the kernel."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # the kernel takes 2-D, contiguous in K
    y = torch.ops.aten._weight_int8pack_mm(x2, codes, scales)  # (M, N)
    return y.reshape(*lead, codes.shape[0])


class Int8Linear(nn.Module):
    """A linear layer stored as int8 codes + per-output-channel scales (buffers: part of the
    state dict, so tensor-parallel workers receive them as they are), the bias as it was."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8)
        )
        self.register_buffer("scales", torch.ones(out_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls.from_weight(linear.weight, linear.bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """A (out, in) weight (an nn.Linear's, or a tied embedding's as the LM head) quantized;
        the tensors given are copied, never shared: a tied embedding stays as it was."""
        out = cls(weight.shape[1], weight.shape[0], bias is not None, weight.dtype)
        out.to(weight.device)
        codes, scales = quantize_per_channel(weight, weight.dtype)
        with torch.no_grad():
            out.weight_int8.copy_(codes)
            out.scales.copy_(scales)
            if bias is not None:
                out.bias.copy_(bias)
        return out

    def quantized_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes, scales, bias) as the layer holds them now, by dict lookups: Projection reads
        them on every call (its cache key), where nn.Module.__getattr__ would cost more than a
        batch-1 matmul of a small layer."""
        bias = self._parameters.get("bias") if "bias" in self._parameters else self.bias
        return self._buffers["weight_int8"], self._buffers["scales"], bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x, self.weight_int8, self.scales)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def check_supported(dtype: torch.dtype, device: str | torch.device) -> None:
    """UnsupportedQuantization unless the int8 kernel runs for activations of `dtype` on
    `device` (probed on a 1x8 @ 8x8 product: the kernel's checks are the authority)."""
    try:
        x = torch.ones(1, 8, dtype=dtype, device=device)
        codes = torch.ones(8, 8, dtype=torch.int8, device=device)
        int8_matmul(x, codes, torch.ones(8, dtype=dtype, device=device))
    except (RuntimeError, NotImplementedError) as err:
        raise UnsupportedQuantization(
            f"quantization 'int8' (aten::_weight_int8pack_mm) does not run for dtype "
            f"{str(dtype).removeprefix('torch.')} on device {str(device)!r}: {err}"
        ) from err
