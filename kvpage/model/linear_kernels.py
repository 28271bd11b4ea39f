"""The linear kernels a Projection (kvpage.model.projection) binds, each named by its fast path
(kvpage.model.kernels.FAST_PATHS), in the order a call tries them: the first bound one whose
rows take x's row count runs; torch's F.linear takes what none does.

Each entry's `bind(layers)` decides once, from the layers' dtypes and shapes and the CPU,
whether the kernel runs for them and at which rows. Adding a linear kernel touches three files:
its native source (native/NAME.cpp), its module (native_NAME.py: a class with `in_features`,
`out_features`, `x_dtype`, `__call__(x)` and `run_unchecked(x, ldx, m, y, threads)`, its
native call made through native_build.call so that the decode tape records it, like
native_gemv.WeightGemv), and its entry in LINEAR_KERNELS here. FAST_PATHS,
EngineConfig.fast_paths_off and the report's coverage (kvpage.verify.path_coverage) take it
from this table."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kvpage.model.native_amx as native_amx
import kvpage.model.native_build as native_build
import kvpage.model.native_gemv as native_gemv
from kvpage.model.widened import widened_linear

ALL_ROWS = 1 << 62
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
Outputs = tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class Layers:
    """One Projection's layers as a kernel is chosen for them (tensors detached)."""

    weights: list[torch.Tensor]  # (out, in) each: float weights, or int8 codes
    scales: list[torch.Tensor | None]  # int8's per-output-channel scales
    biases: list[torch.Tensor | None]
    sizes: list[int]  # out features of each
    x_dtype: torch.dtype  # what x must be: the float weights' dtype, int8 scales'

    @property
    def int8(self) -> bool:
        return self.weights[0].dtype is torch.int8

    @property
    def native_ready(self) -> bool:
        """Every tensor contiguous on the CPU: a native kernel can read them in place."""
        tensors = [t for t in (*self.weights, *self.scales, *self.biases) if t is not None]
        return all(t.is_cpu and t.is_contiguous() for t in tensors)

    def concatenated(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W, b) of all layers as one (sum of out, in) linear layer."""
        bias = None if self.biases[0] is None else torch.cat(self.biases)
        return torch.cat(self.weights), bias

    def split(self, y: torch.Tensor) -> Outputs:
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)


@dataclass(frozen=True, slots=True)
class Bound:
    """A kernel bound to one Projection's layers, for x of `lo`..`hi` rows."""

    path: str
    lo: int
    hi: int
    run: Callable[[torch.Tensor], Outputs]
    kernel: object | None = None  # what it holds: a native kernel object, oneDNN's packed weight

    @property
    def native(self) -> object | None:
        """The native kernel (run_unchecked and the rest); else None."""
        return self.kernel if hasattr(self.kernel, "run_unchecked") else None


@dataclass(frozen=True, slots=True)
class LinearKernel:
    path: str  # its name in FAST_PATHS
    bind: Callable[[Layers], Bound | None]  # None: it does not run for these layers here
    available: Callable[[], bool]  # built, and the CPU has what it needs
    counted: tuple[object, str]  # (owner, attribute) each call goes through: the report's count


def onednn_available() -> bool:
    """oneDNN built in and not switched off (`torch.backends.mkldnn.flags(enabled=False)`)."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def packable_dtype(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs in this dtype on this CPU."""
    if dtype is torch.bfloat16:
        return native_gemv.onednn_bf16()
    return dtype in PACKABLE_DTYPES


def _amx(layers: Layers) -> Bound | None:
    """kvpage's AMX kernel on a repacked copy: bfloat16 at 3-32 rows (kvpage.model.native_amx)."""
    if layers.x_dtype is not torch.bfloat16 or layers.int8 or not native_amx.available():
        return None
    if not (onednn_available() and packable_dtype(torch.bfloat16)) or not layers.native_ready:
        return None
    weight, bias = layers.concatenated()
    if not native_amx.fits(*weight.shape):
        return None
    kernel = native_amx.AmxLinear(weight, bias)
    return Bound("amx", native_amx.MIN_ROWS, native_amx.MAX_ROWS, _split_on(kernel, layers), kernel)


def _gemv(layers: Layers) -> Bound | None:
    """kvpage's weight GEMV over the layers' own tensors, int8 scales in its epilogue, up to
    the rows where it is faster than a GEMM (kvpage.model.native_gemv)."""
    rows = native_gemv.max_rows(layers.x_dtype, layers.weights[0].dtype)
    biases_fit = all(b is None or b.dtype == layers.x_dtype for b in layers.biases)
    if rows == 0 or not biases_fit or not layers.native_ready:
        return None
    kernel = native_gemv.WeightGemv(layers.weights, layers.scales, layers.biases, layers.x_dtype)
    return Bound("gemv", 1, rows, _split_on(kernel, layers), kernel)


def _split_on(kernel, layers: Layers) -> Callable[[torch.Tensor], Outputs]:
    return lambda x: layers.split(kernel(x))


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """x @ W^T + b on oneDNN's packed weight: (M, sum of out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _onednn(layers: Layers) -> Bound | None:
    """oneDNN's matmul on the weights reordered once into its blocked layout."""
    dtype = layers.x_dtype
    if layers.int8 or not (onednn_available() and packable_dtype(dtype)):
        return None
    if not layers.weights[0].is_cpu:
        return None
    weight, bias = layers.concatenated()
    packed = (torch.ops.mkldnn._reorder_linear_weight(weight), bias)
    run = _recordable(lambda x: layers.split(onednn_linear(x, *packed)), layers)
    return Bound("onednn", 1, ALL_ROWS, run, packed)


def _widened(layers: Layers) -> Bound | None:
    """int8 and bfloat16 weights widened to float32 a tile at a time for torch's float32 GEMM
    (kvpage.model.widened): torch's unpacked bfloat16 GEMM runs ~5x slower than its float32
    one, and it has no int8 one for every shape."""
    if not (layers.int8 or layers.x_dtype is torch.bfloat16) or not layers.weights[0].is_cpu:
        return None
    parts = list(zip(layers.weights, layers.scales, layers.biases, strict=True))
    run = _recordable(lambda x: tuple(widened_linear(x, *p) for p in parts), layers)
    return Bound("widened", 1, ALL_ROWS, run)


def _recordable(run: Callable[[torch.Tensor], Outputs], layers: Layers):
    """`run` for a torch kernel, which returns new tensors: while a decode tape records
    (kvpage.model.decode_tape), its outputs are written into a buffer through
    native_build.call instead, so that the tape replays it and the recorded kernels after it
    read that buffer."""

    def recordable(x: torch.Tensor) -> Outputs:
        if not native_build.is_recording():
            return run(x)
        outs = layers.split(torch.empty((*x.shape[:-1], sum(layers.sizes)), dtype=x.dtype))
        native_build.call(_into, run, x, outs)
        return outs

    return recordable


def _into(run: Callable[[torch.Tensor], Outputs], x: torch.Tensor, outs: Outputs) -> None:
    for out, y in zip(outs, run(x), strict=True):
        out.copy_(y)


_HERE = sys.modules[__name__]
LINEAR_KERNELS = (
    LinearKernel("amx", _amx, native_amx.available, (native_amx.AmxLinear, "run_unchecked")),
    LinearKernel("gemv", _gemv, native_gemv.available, (native_gemv.WeightGemv, "run_unchecked")),
    LinearKernel("onednn", _onednn, onednn_available, (_HERE, "onednn_linear")),
    LinearKernel("widened", _widened, lambda: True, (_HERE, "widened_linear")),
)
LINEAR_PATHS = tuple(k.path for k in LINEAR_KERNELS)
