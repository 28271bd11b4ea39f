"""bfloat16 linear layers for decode-sized inputs on AMX tiles (native/amx_linear.cpp), built at
first use where torch reports AMX (a Sapphire Rapids or later Xeon), like the other kernels
(kvpage.model.native_build).

Why: between the weight GEMV's few rows and a prefill's hundreds, a decode step's 3-32 rows
went to oneDNN's AMX GEMM, which on a 2-core Xeon took about as long at 32 rows as at one and
read the weights at ~20 GB/s; this kernel streams them once per 32 rows, 1.2-1.5x faster at
4-32 rows (bench/int8_weights.py --kernel-sweep --kinds bf16). It keeps its own copy of the
weights in the tiles' layout, so a model in bfloat16 holds one more copy of its projections where
it runs. KVPAGE_AMX=0 turns it off (oneDNN then takes those rows)."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

import kvpage.model.native_build as native_build
import kvpage.model.native_gemv as native_gemv

SOURCE = Path(__file__).parent / "native" / "amx_linear.cpp"
MAX_ROWS = 32  # one pass of the kernel's two row tiles; above, oneDNN's blocking wins
MIN_ROWS = 3  # at 1-2 rows the weight GEMV streams as fast without a second copy
ALIGN = 32  # K and N: multiples of the kernel's K step and output block


def enabled() -> bool:
    return os.environ.get("KVPAGE_AMX", "1") != "0" and native_build.enabled()


def fits(n: int, k: int) -> bool:
    """Whether an (n, k) weight takes the kernel's layout."""
    return n % ALIGN == 0 and k % ALIGN == 0 and n > 0 and k > 0


def available() -> bool:
    return enabled() and _library() is not None


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not torch.cpu._is_amx_tile_supported():
        return None
    lib = native_build.load(SOURCE, "the AMX linear", _bind)
    if lib is None or not lib.kvpage_amx_ready():  # the kernel may not use the tiles here
        return None
    return lib


def library() -> ctypes.CDLL | None:
    """The built kernel (None where it is not), e.g. to know its entry points."""
    return _library()


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvpage_amx_ready.restype = ctypes.c_int
    lib.kvpage_amx_ready.argtypes = []
    lib.kvpage_amx_pack.restype = None
    lib.kvpage_amx_pack.argtypes = [ptr, i64, i64, ptr]
    lib.kvpage_amx_run.restype = None
    lib.kvpage_amx_run.argtypes = [ctypes.POINTER(_Plan), ptr, i64, i64, ptr, ctypes.c_int]
    return lib


class _Plan(ctypes.Structure):  # AmxPlan in the kernel
    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out_features", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
    ]


class AmxLinear:
    """y = x @ W^T + b for bfloat16 x of up to MAX_ROWS rows, over a repacked copy of W (N, K);
    called like kvpage.model.native_gemv.WeightGemv (`__call__`, `run_unchecked`)."""

    x_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        lib = _library()
        if lib is None:
            raise native_build.NativeBuildError("the AMX linear kernel is not available")
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or not fits(n, k) or weight.device.type != "cpu":
            raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype}: bfloat16 (N, K) on "
                             f"CPU, both multiples of {ALIGN}")  # fmt: skip
        if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16):
            raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} for {n} bfloat16 outputs")
        weight = weight.detach().contiguous()
        self.packed = torch.empty_like(weight)
        lib.kvpage_amx_pack(weight.data_ptr(), n, k, self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().contiguous()
        self.in_features, self.out_features = k, n
        bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self._plan = ctypes.pointer(_Plan(self.packed.data_ptr(), bias_ptr, n, k))
        self._call = lib.kvpage_amx_run

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) bfloat16 on CPU, at most MAX_ROWS rows -> (..., N), into `out` (M, N)
        contiguous where given (x then 2-D)."""
        return native_gemv.call_on_rows(self, x, out, MAX_ROWS)

    def run_unchecked(self, x: int, ldx: int, m: int, y: int, threads: int) -> int:
        """The kernel on raw addresses (x: m rows ldx apart; y: (m, N) contiguous), no checks:
        for a caller that checked its buffers (native_gemv.call_on_rows). Returns y."""
        native_build.call(self._call, self._plan, x, ldx, m, y, threads)
        return y
