"""Linear layers for decode-sized batches (native/weight_gemv.cpp): y = (x @ W^T) * scale + bias
for a few rows of x, built at first use like the paged decode kernel (kvpage.model.native_build).

Why: a batch-1 decode step reads every weight once per token and does two flops per weight read,
so it is bound by memory bandwidth, and the kernel that reads the fewest bytes per weight wins.
torch's int8 kernel (`aten::_weight_int8pack_mm`) reads int8 codes but runs slower than the fp32
GEMM at one row (bench/int8_weights.py), and oneDNN's bf16 GEMM is slower at one row than its
bandwidth allows; this kernel streams each weight row once, widening it in registers, and
applies the int8 scale and the bias in its epilogue. It runs while the rows of x are at most
`max_rows(kind)` (measured, per vector width: beyond it a GEMM blocked for reuse is faster);
Projection keeps torch's GEMMs (or kvpage.model.widened) for the rest, and for everything when
`available()` is False (no compiler, or KVPAGE_NATIVE=0).

Numerics: float32 accumulation, the epilogue `acc * scale + bias` in float32 and one rounding to
x's dtype; the summation order (16 or 8 interleaved partial sums, by the CPU's vector width,
then pairwise) differs from torch's, so results agree with torch to accumulation-order rounding,
not bit for bit."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

import kvpage.model.native_build as native_build  # not `from kvpage.model`: an import cycle
from kvpage.model.native_build import NativeBuildError

SOURCE = Path(__file__).parent / "native" / "weight_gemv.cpp"
# (activation dtype, weight dtype) -> the kernel's `kind`
KINDS = {
    (torch.float32, torch.int8): 0,
    (torch.bfloat16, torch.int8): 1,
    (torch.bfloat16, torch.bfloat16): 2,
    (torch.float32, torch.float32): 3,
}
# Per vector width of the built kernel (16 float lanes: AVX-512; 8: AVX2), per kind, the most
# rows of x the kernel takes (bench/int8_weights.py --kernel-sweep, 125M shapes, 2 threads).
# 16 lanes (a Xeon with AVX512-BF16): bf16 and fp32 1.2-1.8x oneDNN's speed at 1-8 rows (the
# kernel reads each weight once at close to the memory's bandwidth), bf16 still ahead at 16, both
# behind at 32; int8 every row count: torch's int8 kernel is slower at one row, ~27x slower at 16
# with float32 x, and in torch 2.13 wrong for bfloat16 x when K % 16 != 0
# (tests/model/test_native_gemv.py). 8 lanes (an AMD EPYC with AVX2, where oneDNN has no bf16
# GEMM): fp32 1.2-1.8x oneDNN's to 16 rows, 0.8x at 32; bf16 and int8 ahead of float32 GEMMs on
# widened weights (kvpage.model.widened) to 64 rows, 0.5x of them at 2048 rows, where the
# kernel's re-reading of x for every few weight rows costs more than widening the weight once.
# With AMX (a Sapphire Rapids Xeon) oneDNN's bf16 GEMM runs on tiles and is bandwidth-bound
# from one row up: the kernel is 1.1-1.4x its speed to 4 rows, 0.6-0.8x at 8, 0.3x at 16
# (bench/int8_weights.py --kernel-sweep --kinds bf16, 2 threads). From 3 rows kvpage's own AMX
# kernel (kvpage.model.native_amx) takes them where it is built, ahead of both.
ALL_ROWS = 1 << 62
MAX_ROWS = {
    16: {0: ALL_ROWS, 1: ALL_ROWS, 2: 16, 3: 8},
    8: {0: 64, 1: 64, 2: 64, 3: 16},
}
AMX_BF16_ROWS = 4


def available() -> bool:
    return _library() is not None


def max_rows(x_dtype: torch.dtype, w_dtype: torch.dtype) -> int:
    """How many rows of x the kernel takes for these dtypes (0: none, or unavailable)."""
    kind = KINDS.get((x_dtype, w_dtype))
    if kind is None or not available():
        return 0
    override = os.environ.get("KVPAGE_GEMV_MAX_ROWS")  # benchmarks sweep the threshold
    if override is not None:
        return int(override)
    if kind == KINDS[(torch.bfloat16, torch.bfloat16)] and _amx():
        return AMX_BF16_ROWS
    return MAX_ROWS[lanes()][kind]


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN has a bfloat16 GEMM on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses to pack bfloat16 weights without them."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def _amx() -> bool:
    """Whether torch's oneDNN runs bfloat16 GEMMs on AMX tiles here."""
    return bool(torch.cpu._is_amx_tile_supported()) and onednn_bf16()


def lanes() -> int:
    """float32 lanes of the built kernel's vectors (16: AVX-512, 8: AVX2 and the rest)."""
    return _library().kvpage_gemv_lanes()


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native_build.load(SOURCE, "the weight GEMV", _bind)


def library() -> ctypes.CDLL | None:
    """The built kernel (None where it is not): its entry points, for tests that call them."""
    return _library()


MAX_SEGMENTS = 8  # kMaxSegments in the kernel


class _Plan(ctypes.Structure):
    """The kernel's `Plan`: what a layer's calls share, built once."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("segments", ctypes.c_int32),
        ("in_features", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("w", ctypes.c_void_p * MAX_SEGMENTS),
        ("scale", ctypes.c_void_p * MAX_SEGMENTS),
        ("bias", ctypes.c_void_p * MAX_SEGMENTS),
        ("rows", ctypes.c_int64 * MAX_SEGMENTS),
    ]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.kvpage_gemv_max_segments.restype = ctypes.c_int
    lib.kvpage_gemv_max_segments.argtypes = []
    lib.kvpage_gemv_lanes.restype = ctypes.c_int
    lib.kvpage_gemv_lanes.argtypes = []
    if lib.kvpage_gemv_lanes() not in MAX_ROWS:
        raise NativeBuildError(f"weight_gemv.cpp built with {lib.kvpage_gemv_lanes()} lanes")
    if lib.kvpage_gemv_max_segments() != MAX_SEGMENTS:
        raise NativeBuildError("weight_gemv.cpp and native_gemv.py disagree on MAX_SEGMENTS")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvpage_weight_gemv.restype = None
    lib.kvpage_weight_gemv.argtypes = [ctypes.POINTER(_Plan), ptr, i64, i64, ptr, ctypes.c_int]
    return lib


class WeightGemv:
    """y = concat_s((x @ W_s^T) * scale_s + bias_s) for weight segments sharing their input (q, k
    and v as they lie: no concatenated copy). Checked once here; a call checks only x."""

    def __init__(
        self,
        weights: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        biases: list[torch.Tensor | None],
        x_dtype: torch.dtype,
    ) -> None:
        lib = _library()
        if lib is None:
            raise NativeBuildError("the weight GEMV kernel is not available")
        n = len(weights)
        if not 1 <= n <= MAX_SEGMENTS or len(scales) != n or len(biases) != n:
            raise ValueError(f"{n} weight segments, {len(scales)} scales, {len(biases)} biases")
        kind = KINDS.get((x_dtype, weights[0].dtype))
        if kind is None:
            raise ValueError(f"no kernel for {x_dtype} activations and {weights[0].dtype} weights")
        k = weights[0].shape[1] if weights[0].dim() == 2 else -1
        for w, s, b in zip(weights, scales, biases, strict=True):
            _check_segment(w, s, b, weights[0].dtype, k, x_dtype)
        # The tensors stay referenced: the kernel reads them through the plan's raw pointers.
        self._keep = [t for t in (*weights, *scales, *biases) if t is not None]
        self.in_features, self.out_features = k, sum(w.shape[0] for w in weights)
        self.x_dtype, self.weight_dtype = x_dtype, weights[0].dtype
        plan = _Plan(kind=kind, segments=n, in_features=k, out_features=self.out_features)
        for i, (w, s, b) in enumerate(zip(weights, scales, biases, strict=True)):
            plan.w[i] = w.data_ptr()
            plan.scale[i] = None if s is None else s.data_ptr()
            plan.bias[i] = None if b is None else b.data_ptr()
            plan.rows[i] = w.shape[0]
        self._plan = ctypes.pointer(plan)
        self._call = lib.kvpage_weight_gemv

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) in x_dtype on CPU -> (..., N), into `out` (M, N) contiguous where given
        (x then 2-D). Lean: it runs ~50 times per decode step."""
        return call_on_rows(self, x, out)

    def run_unchecked(self, x: int, ldx: int, m: int, y: int, threads: int) -> int:
        """The kernel on raw addresses, no checks: for a caller that checked its buffers against
        in_features, out_features and x_dtype once (call_on_rows). Returns y."""
        native_build.call(self._call, self._plan, x, ldx, m, y, threads)
        return y


def call_on_rows(
    kernel, x: torch.Tensor, out: torch.Tensor | None = None, max_rows: int | None = None
) -> torch.Tensor:
    """A native linear kernel (WeightGemv, kvpage.model.native_amx.AmxLinear: in_features,
    out_features, x_dtype, run_unchecked) on a tensor: x and `out` checked as WeightGemv.__call__
    says, at most `max_rows` rows where given."""
    shape, k, n = x.shape, kernel.in_features, kernel.out_features
    if x.dtype != kernel.x_dtype or shape[-1] != k or not x.is_cpu:
        raise ValueError(
            f"x {tuple(shape)} {x.dtype} {x.device} does not fit a kernel for "
            f"{kernel.x_dtype} (..., {k}) on CPU"
        )
    x2 = x.reshape(-1, k) if len(shape) != 2 else x
    if not x2.is_contiguous():
        x2 = x2.contiguous()  # the kernel reads rows of K contiguous values
    m = x2.shape[0]
    if max_rows is not None and not 0 < m <= max_rows:
        raise ValueError(f"{m} rows: the kernel takes 1 to {max_rows}")
    y = torch.empty(m, n, dtype=kernel.x_dtype) if out is None else out
    if out is not None and (
        out.shape != (m, n) or out.dtype != kernel.x_dtype or not out.is_contiguous()
    ):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} for ({m}, {n})")
    kernel.run_unchecked(x2.data_ptr(), k, m, y.data_ptr(), torch.get_num_threads())
    return y if len(shape) == 2 else y.view(*shape[:-1], n)


def _check_segment(
    w: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    w_dtype: torch.dtype,
    k: int,
    x_dtype: torch.dtype,
) -> None:
    if w.dim() != 2 or w.shape[1] != k or w.dtype != w_dtype or not w.is_contiguous():
        raise ValueError(f"weight {tuple(w.shape)} {w.dtype}: every segment (rows, {k}) contiguous")
    if w.device.type != "cpu":
        raise ValueError(f"the kernel runs on CPU, not {w.device}")
    for name, t in (("scale", scale), ("bias", bias)):
        if t is None:
            continue
        if t.shape != (w.shape[0],) or t.dtype != x_dtype or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype}: ({w.shape[0]},) in {x_dtype}")
    if (w_dtype == torch.int8) != (scale is not None):
        raise ValueError("int8 weights take per-channel scales; float weights none")
