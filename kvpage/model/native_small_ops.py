"""RMSNorm (with the residual add before it; Gemma's with a float32 weight), LayerNorm likewise,
rotary embedding, a gated MLP's silu(gate) * up or gelu_tanh(gate) * up and GPT-2's gelu_new as
single native calls
(native/small_ops.cpp), built at first use like the other kernels (kvpage.model.native_build).

Why: at batch 1 a decode step is ~40 torch ops per layer besides the matmuls, and on a 768-wide
row each op's dispatch costs more than its arithmetic: RMSNorm alone is six ops, rotary on q and
k fourteen. The kernels compute what the torch code in kvpage.model.layers computes, rounding
where it rounds; only the sum of squares is added in another order (float32 either way).

`supports(x)` says whether a tensor can take them: float32 or bfloat16 on CPU, no autograd, the
kernel built (KVPAGE_NATIVE=0 turns it off). Callers keep their torch path for the rest."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

import kvpage.model.native_build as native_build  # not `from kvpage.model`: an import cycle

SOURCE = Path(__file__).parent / "native" / "small_ops.cpp"
FLAGS = (*native_build.FLAGS, "-ffp-contract=off")  # torch rounds a * b and + c apart
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
WIDE_WEIGHT = 2  # kvpage_rms_norm's bfloat16 rows with a float32 weight, rounded once (Gemma's)


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native_build.load(SOURCE, "the small ops", _bind, FLAGS)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.kvpage_rms_norm.restype = None
    lib.kvpage_rms_norm.argtypes = [i32, ptr, i64, ptr, i64, ptr, f32, i64, i64, ptr, ptr, i32]
    lib.kvpage_layer_norm.restype = None
    lib.kvpage_layer_norm.argtypes = [
        i32,
        ptr,
        i64,
        ptr,
        i64,
        ptr,
        ptr,
        f32,
        i64,
        i64,
        ptr,
        ptr,
        i32,
    ]
    lib.kvpage_gelu_new.restype = None
    lib.kvpage_gelu_new.argtypes = [i32, ptr, i64, i64, ptr, i64, i32]
    lib.kvpage_rotary.restype = None
    lib.kvpage_rotary.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, ptr, i64, i32]
    for gated in (lib.kvpage_silu_mul, lib.kvpage_gelu_tanh_mul):  # one signature
        gated.restype = None
        gated.argtypes = [i32, ptr, ptr, i64, i64, ptr, i64, i32]
    return lib


def library() -> ctypes.CDLL:
    """The built kernels, for callers that pass raw addresses they checked once
    (tests that call an entry point); only where `available()`."""
    return _library()


def available() -> bool:
    return _library() is not None


def supports(x: torch.Tensor) -> bool:
    return x.dtype in DTYPES and x.is_cpu and not x.requires_grad and available()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(x + delta or None, RMSNorm(x + delta)) over the last dim of 2-D x; x and delta may be
    row-strided views. The outputs are new contiguous tensors, or `out` and `total` where given
    (contiguous; `total` may be x itself: the sum is taken element by element). A float32
    `weight` with bfloat16 x: the normed row times the weight in float32, rounded once
    (GemmaRMSNorm's, its weight 1 + w); else the weight is x's dtype and the normed row is
    rounded before the product (RMSNorm's)."""
    n, c = x.shape
    _check_rows(x, c)
    wide = weight.dtype is torch.float32
    if weight.shape != (c,) or not (wide or weight.dtype == x.dtype) or not weight.is_contiguous():
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} {weight.dtype} for rows {x.shape}")
    out, residual, total = _norm_outputs(x, delta, out, total)
    native_build.call(
        _library().kvpage_rms_norm,
        WIDE_WEIGHT if wide and x.dtype is torch.bfloat16 else DTYPES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        *residual,
        weight.data_ptr(),
        *_rows_into(eps, n, c, total, out),
    )
    return total, out


def _norm_outputs(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    out: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[int | None, int], torch.Tensor | None]:
    """A norm kernel's normed rows, residual arguments (_residual) and sum (None without a
    residual): `out` and `total` where given, else new tensors."""
    residual = _residual(delta, x)
    return _output(out, x), residual, None if delta is None else _output(total, x)


def _residual(delta: torch.Tensor | None, x: torch.Tensor) -> tuple[int | None, int]:
    """A norm kernel's fused residual add: delta's (address, row stride), checked against x;
    (None, 0) without one."""
    if delta is None:
        return None, 0
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"residual {tuple(delta.shape)} {delta.dtype} for {tuple(x.shape)}")
    _check_rows(delta, x.shape[1])
    return delta.data_ptr(), delta.stride(0)


def _rows_into(eps: float, n: int, c: int, total: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """A norm kernel's last arguments: eps, the rows' shape, where the sum (or None) and the
    normed rows go, and the threads."""
    total_ptr = None if total is None else total.data_ptr()
    return eps, n, c, total_ptr, out.data_ptr(), torch.get_num_threads()


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(x + delta or None, LayerNorm(x + delta)) with weight and bias of x's dtype, as rms_norm
    (new contiguous outputs); the normed row rounded once, as torch's layer_norm."""
    n, c = x.shape
    _check_rows(x, c)
    for t in (weight, bias):
        if t.shape != (c,) or t.dtype != x.dtype or not t.is_contiguous():
            raise ValueError(f"LayerNorm weight {tuple(t.shape)} {t.dtype} for rows {x.shape}")
    out, residual, total = _norm_outputs(x, delta)
    native_build.call(
        _library().kvpage_layer_norm,
        DTYPES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        *residual,
        weight.data_ptr(),
        bias.data_ptr(),
        *_rows_into(eps, n, c, total, out),
    )
    return total, out


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's gelu_new of 2-D x (rows contiguous), every op rounded to the dtype as torch's
    chain of ops rounds it (kvpage.model.layers.gelu_new); a new contiguous tensor."""
    n, c = x.shape
    _check_rows(x, c)
    out = _output(None, x)
    native_build.call(
        _library().kvpage_gelu_new,
        DTYPES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        c,
        out.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q (N, H, D) and k (N, KVH, D) in place by cos, sin (N, 1, R): the first R <= D
    values of each head (R < D: a partial rotary factor). Each row's heads must be contiguous
    (a view of a fused qkv output is)."""
    n, _, d = q.shape
    r = cos.shape[-1]
    for t in (q, k):
        if t.dtype != q.dtype or t.shape[0] != n or t.shape[2] != d or t.stride()[1:] != (d, 1):
            raise ValueError(f"rotary input {tuple(t.shape)} strides {t.stride()}")
    for t in (cos, sin):
        if t.shape != (n, 1, r) or r > d or r % 2 or t.dtype != q.dtype or not t.is_contiguous():
            raise ValueError(f"rotary table {tuple(t.shape)} {t.dtype} for q {tuple(q.shape)}")
    native_build.call(
        _library().kvpage_rotary,
        DTYPES[q.dtype],
        q.data_ptr(),
        q.stride(0),
        q.shape[1],
        k.data_ptr(),
        k.stride(0),
        k.shape[1],
        r,
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        n,
        torch.get_num_threads(),
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up, each rounded to the dtype as torch rounds it, for 2-D gate and up of one
    shape and row stride (the two halves of a fused gate/up output); a new contiguous tensor,
    or `out`."""
    return _gated_mul(_library().kvpage_silu_mul, gate, up, out)


def gelu_tanh_mul(
    gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """F.gelu(gate, approximate="tanh") * up (GeGLU's), as silu_mul."""
    return _gated_mul(_library().kvpage_gelu_tanh_mul, gate, up, out)


def _gated_mul(kernel, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None):
    n, c = gate.shape
    _check_rows(gate, c)
    if up.shape != gate.shape or up.dtype != gate.dtype or up.stride() != gate.stride():
        raise ValueError(f"up {tuple(up.shape)} {up.stride()} for gate {tuple(gate.shape)}")
    out = _output(out, gate)
    native_build.call(
        kernel,
        DTYPES[gate.dtype],
        gate.data_ptr(),
        up.data_ptr(),
        gate.stride(0),
        c,
        out.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    return out


def _output(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype)
    if out.shape != like.shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"output {tuple(out.shape)} {out.dtype} for {tuple(like.shape)}")
    return out


def _check_rows(x: torch.Tensor, c: int) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.stride(0) < c:
        raise ValueError(f"rows of {tuple(x.shape)} with strides {x.stride()}: each row contiguous")
