"""A Llama decode step's kernel calls made from one native call (native/decode_step.cpp): the
loop over layers of kvpage.model.decode_plan in C, calling the linear (weight GEMV or AMX),
small-op and paged attention kernels through their entry points' addresses, in the Python loop's
order with its arguments.

Why: at batch 1 the loop's ~120 ctypes calls a step, each converting a dozen arguments, and the
Python between them cost about 1 ms of a 125M model's bfloat16 step, more than the small kernels
they call. `FusedStep.of(...)` is None where any layer's projection is not one of the native
linear kernels at the step's rows (kvpage.model.linear_kernels: one with `entry_address`; the
loop then runs: those go through torch) or a kernel is not built."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

import kvpage.model.native_attention as native_attention
import kvpage.model.native_build as native_build
import kvpage.model.native_small_ops as native_small_ops

SOURCE = Path(__file__).parent / "native" / "decode_step.cpp"
_ptr, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [
        (name, _ptr) for name in ("rms_norm", "rotary", "silu_mul", "paged_write", "paged_decode")
    ]


class _Linear(ctypes.Structure):
    _fields_ = [("run", _ptr), ("plan", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _Linear) for name in ("qkv", "out", "gate_up", "down")),
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("input_eps", _f32),
        ("post_eps", _f32),
        ("k_pool", _ptr),
        ("v_pool", _ptr),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("dtype", _i32),
        ("threads", _i32),
        *((name, _i64) for name in ("layers", "m", "c", "heads", "kv_heads", "head_dim")),
        ("intermediate", _i64),
        *((name, _ptr) for name in ("x", "qkv", "attn", "o", "h", "gate_up", "act", "down")),
        ("hidden", _ptr),
        ("final_norm", _ptr),
        ("final_eps", _f32),
        ("scale", _f32),
        *((name, _ptr) for name in ("cos", "sin", "slots", "tables", "lens")),
        *((name, _i64) for name in ("max_blocks", "block_size", "block_stride", "token_stride")),
        ("head_stride", _i64),
        ("scratch", _ptr),
        ("scratch_per_thread", _i64),
        ("layer", ctypes.POINTER(_Layer)),
    ]


def available() -> bool:
    return _library() is not None and kernels() is not None


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native_build.load(SOURCE, "the one-call decode step", _bind)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.kvpage_decode_step.restype = None
    lib.kvpage_decode_step.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Step)]
    return lib


@functools.cache
def kernels() -> _Kernels | None:
    """The entry points a step calls (None where a library is not built); a FusedStep takes
    them when it is built, so a test can plant a kernel of the same signature through here."""
    ops, attention = native_small_ops.library(), native_attention.library()
    if ops is None or attention is None:
        return None

    def address(fn) -> int:
        return ctypes.cast(fn, _ptr).value

    return _Kernels(
        rms_norm=address(ops.kvpage_rms_norm),
        rotary=address(ops.kvpage_rotary),
        silu_mul=address(ops.kvpage_silu_mul),
        paged_write=address(attention.kvpage_paged_write),
        paged_decode=address(attention.kvpage_paged_decode),
    )


class FusedStep:
    """One row count's step over a plan's buffers, its layers' linear kernels, norms and a KV
    pool (all checked by the plan when it built them); `run` sets the step's own addresses and
    calls. Holds the layers' array and the kernels: the C side reads their plans through raw
    pointers."""

    def __init__(self, step: _Step, layers: ctypes.Array, linears: list) -> None:
        self._step, self._layers = step, layers
        self.linears = linears  # what a run calls, in order: q/k/v, o, gate/up, down per layer
        self._kernels = kernels()

    @classmethod
    def of(
        cls, plan, buf, layer_kernels: list[tuple], pools, norm_weights: list[int]
    ) -> FusedStep | None:
        """For plan (a LlamaDecodePlan), buf (its _Buffers), the per-layer (q/k/v, o, gate/up,
        down) kernels, pools (a native_attention.PoolLayout) and every norm's weight address in
        the plan's order (input norms, post norms, the final norm); None where a kernel is not
        a native linear kernel (plan_address, entry_address) or the native code is not there."""
        native = all(hasattr(k, "entry_address") for ks in layer_kernels for k in ks)
        if not available() or not native:
            return None
        n, eps = len(layer_kernels), plan.norm_eps
        layers = (_Layer * n)()
        for i, linears in enumerate(layer_kernels):
            k, v = pools.addresses(i)
            layers[i] = _Layer(
                *(_Linear(g.entry_address(), g.plan_address()) for g in linears),
                norm_weights[i],
                norm_weights[n + i],
                eps[i],
                eps[n + i],
                k,
                v,
            )
        m, c = buf.h.shape
        step = _Step(
            dtype=pools.dtype_code,
            layers=n,
            m=m,
            c=c,
            heads=plan.heads,
            kv_heads=plan.kv_heads,
            head_dim=plan.head_dim,
            intermediate=plan.intermediate,
            final_norm=norm_weights[-1],
            final_eps=eps[-1],
            scale=plan.scale,
            block_size=pools.block_size,
            layer=layers,
        )
        for name in ("qkv", "attn", "o", "h", "gate_up", "act", "down"):
            setattr(step, name, getattr(buf.ptr, name))
        step.block_stride, step.token_stride, step.head_stride = pools.strides
        return cls(step, layers, [g for linears in layer_kernels for g in linears])

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        decode: native_attention.PagedDecode,
        hidden: torch.Tensor,
        threads: int,
    ) -> None:
        """x (m, c) contiguous, overwritten with the residual stream; the final norm's output
        into hidden (m, c) contiguous. cos, sin (m, 1, head_dim) and slots (m,) contiguous, the
        slots checked inside the pool; decode: this step's block tables and lengths, m rows."""
        s = self._step
        scratch, per_thread = decode.scratch(s.heads, s.kv_heads, s.head_dim, s.block_size, threads)
        s.threads, s.x, s.hidden = threads, x.data_ptr(), hidden.data_ptr()
        s.cos, s.sin, s.slots = cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        s.tables, s.lens = decode.tables.data_ptr(), decode.lens.data_ptr()
        s.max_blocks = decode.tables.shape[1]
        s.scratch, s.scratch_per_thread = scratch, per_thread
        _library().kvpage_decode_step(ctypes.byref(self._kernels), ctypes.byref(s))
