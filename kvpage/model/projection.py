"""Several linear layers over the same input computed as one matmul, with the weight prepacked for
oneDNN on CPU.

Why: a decode step multiplies ~32 rows by each weight. At that shape the plain fp32 GEMM runs at
a third of what oneDNN reaches with a weight reordered once into its blocked layout
(bench/decode_profile.py), and q/k/v (or gate/up) as three (two) small matmuls waste more. The
nn.Linear modules stay the owners of the parameters (checkpoint names, tying, training); the packed
copy is a cache keyed by each weight's storage and version counter, so an in-place update or a
`.to()` repacks instead of serving stale weights. Autograd never sees the packed path.

Decode-sized inputs (at most `native_gemv.max_rows` rows: batch-1 decode, the LM head on a few
rows) go to kvpage's weight GEMV kernel (kvpage.model.native_gemv) where it is built: it reads
the layers' own weights (no copy), one pass per call, and is faster there than either torch
kernel; the same cache key rebuilds it. Int8Linear layers (kvpage.model.int8) take it with their
scales fused in its epilogue. Above its rows, and where oneDNN cannot pack the dtype (bfloat16
without AVX-512), int8 and bfloat16 weights are widened to float32 a tile at a time for torch's
float32 GEMM (kvpage.model.widened)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kvpage.model.native_amx as native_amx
from kvpage.errors import InvariantViolation
from kvpage.model.int8 import Int8Linear
from kvpage.model.kernels import all_allowed, allowed
from kvpage.model.native_gemv import WeightGemv, max_rows, onednn_bf16
from kvpage.model.widened import widened_linear

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    """oneDNN built in and not switched off (`torch.backends.mkldnn.flags(enabled=False)`)."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def packable_dtype(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs in this dtype on this CPU."""
    if dtype is torch.bfloat16:
        return onednn_bf16()
    return dtype in PACKABLE_DTYPES


class Projection:
    """y_1, ..., y_n = x W_1^T + b_1, ..., x W_n^T + b_n for layers that share their input: nn.Linear,
    or any module with a (out, in) `weight` and an optional `bias` (a tied embedding as LM head)."""

    def __init__(self, *linears: nn.Module) -> None:
        # A plain tuple, not submodules: the parameters keep their single checkpoint name.
        self.linears = linears
        self.int8 = _all_int8(linears)
        self.sizes = [_out_features(lin) for lin in linears]
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._gemv: WeightGemv | None = None  # built with the pack, if it runs
        self._gemv_rows = 0  # the most rows of x it takes
        self._amx: native_amx.AmxLinear | None = None  # bfloat16 at 3-32 rows where the CPU has AMX
        # Where each float layer keeps its tensors (read on every call for the cache key: a dict
        # lookup, not nn.Module.__getattr__, which cost more than the batch-1 matmul it guards).
        self._slots = [_slots(lin) for lin in linears]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not all_allowed():
            return self._restricted(x)
        if self.int8:
            return self._int8_call(x)
        if not self._fast(x):
            return self._plain(x)
        if self._key != self._current_key():
            self._pack()
        if self._use_amx(x):
            return self._split(self._amx(x))
        if self._use_gemv(x):
            return self._split(self._gemv(x))
        y = self.packed_unchecked(x)  # the key was just checked
        if y is None:  # oneDNN cannot pack this dtype on this CPU
            return self._unpacked(x)
        return self._split(y)

    def tensor_slots(self) -> list[tuple[dict, str]] | None:
        """(dict, name) of every tensor the packed copies depend on, where the layers keep them
        in their parameter or buffer dicts: a caller's cache key can read them directly. None
        where one is a plain attribute (read through getattr: no slot to watch)."""
        found = []
        for lin, slots in zip(self.linears, self._slots, strict=True):
            if self.int8:
                found += [(lin._buffers, "weight_int8"), (lin._buffers, "scales")]
                slots = slots[1:]  # the bias
            for owner, name in slots:
                if owner is None and getattr(lin, name, None) is not None:
                    return None
                if owner is not None:
                    found.append((owner, name))
        return found

    def gemv_for(self, x: torch.Tensor) -> WeightGemv | native_amx.AmxLinear | None:
        """The native kernel this call would run on x (the weight GEMV, or the AMX kernel), over
        the layers' current tensors, or None where another path would
        (kvpage.model.decode_plan calls it with its own output buffers)."""
        if not all_allowed():
            return None  # the decode plan, its only caller, runs with every path on
        if self.int8:
            if self._key != self._current_key():
                self._refresh_int8()
        elif not self._fast(x):
            return None
        elif self._key != self._current_key():
            self._pack()
        if self._use_amx(x):
            return self._amx
        return self._gemv if self._use_gemv(x) else None

    def packed_unchecked(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T + b, all layers in one (M, sum of sizes) output, on oneDNN's packed weight as
        it is, or None where there is none (int8, a dtype oneDNN cannot pack). No key check: for
        a caller that checked the weights since `gemv_for` (kvpage.model.decode_plan)."""
        if self._weight is None or self.int8:
            return None
        return torch.ops.mkldnn._linear_pointwise(x, self._weight, self._bias, "none", [], "")

    def _restricted(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """__call__ with some fast paths off (kvpage.model.kernels): each taken only where
        allowed, in __call__'s order; torch's operators where none is."""
        if self.int8:
            if self._key != self._current_key():
                self._refresh_int8()
            if allowed("gemv") and self._use_gemv(x):
                return self._split(self._gemv(x))
            if allowed("widened"):
                return tuple(widened_linear(x, *lin.quantized_tensors()) for lin in self.linears)
            return self._torch_only(x)
        if not self._fast(x):
            return self._plain(x)
        if self._key != self._current_key():
            self._pack()
        if allowed("amx") and self._use_amx(x):
            return self._split(self._amx(x))
        if allowed("gemv") and self._use_gemv(x):
            return self._split(self._gemv(x))
        y = self.packed_unchecked(x) if allowed("onednn") else None
        if y is not None:
            return self._split(y)
        return self._unpacked(x) if allowed("widened") else self._plain(x)

    def _torch_only(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """torch's operators alone (kvpage.model.kernels.torch_kernels): int8 weights
        dequantised in float32 as the format defines them (kvpage.model.int8)."""
        if not self.int8:
            return self._plain(x)
        outs = []
        for lin in self.linears:
            codes, scales, bias = lin.quantized_tensors()
            weight = codes.float() * scales.float()[:, None]
            y = F.linear(x.float(), weight, None if bias is None else bias.float())
            outs.append(y.to(x.dtype))
        return tuple(outs)

    def _plain(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, lin.weight, _bias(lin)) for lin in self.linears)

    def _unpacked(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # torch's unpacked bfloat16 GEMM runs ~5x slower than its float32 one on the same values.
        if x.dtype is not torch.bfloat16:
            return self._plain(x)
        return tuple(
            widened_linear(x, lin.weight.detach(), None, _detached(_bias(lin)))
            for lin in self.linears
        )

    def _use_gemv(self, x: torch.Tensor) -> bool:
        # No autograd through the kernel: an input that needs gradients takes torch's path.
        return (
            0 < _rows(x) <= self._gemv_rows
            and x.dtype == self._gemv.x_dtype
            and x.is_cpu
            and not x.requires_grad
        )

    def _use_amx(self, x: torch.Tensor) -> bool:
        return (
            self._amx is not None
            and native_amx.MIN_ROWS <= _rows(x) <= native_amx.MAX_ROWS
            and x.dtype is torch.bfloat16
            and x.is_cpu
            and not x.requires_grad
        )

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)

    def _int8_call(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._key != self._current_key():
            self._refresh_int8()
        if self._use_gemv(x):
            return self._split(self._gemv(x))  # the bias added in the kernel, in float32
        return tuple(widened_linear(x, *lin.quantized_tensors()) for lin in self.linears)

    def _build_gemv(self, weights: list, scales: list, x_dtype: torch.dtype) -> None:
        """The native kernel over the layers' own tensors, where it runs for these dtypes."""
        self._gemv, self._gemv_rows = None, 0
        rows = max_rows(x_dtype, weights[0].dtype)
        tensors = [*weights, *(s for s in scales if s is not None)]
        if rows == 0 or not all(t.is_contiguous() and t.is_cpu for t in tensors):
            return
        biases = [_bias(lin) for lin in self.linears]
        biases = [None if b is None else b.detach() for b in biases]
        if any(b is not None and (b.dtype != x_dtype or not b.is_contiguous()) for b in biases):
            return
        self._gemv = WeightGemv(weights, scales, biases, x_dtype)
        self._gemv_rows = rows

    def _refresh_int8(self) -> None:
        """After a change of the layers' tensors: the kernel rebuilt on them."""
        codes = [lin.weight_int8 for lin in self.linears]
        scales = [lin.scales for lin in self.linears]
        self._build_gemv(codes, scales, scales[0].dtype)
        self._key = self._current_key()

    def _fast(self, x: torch.Tensor) -> bool:
        """Whether x can take the packed or the native path (else plain F.linear)."""
        weight = self.linears[0].weight
        return (
            x.is_cpu
            and x.dtype == weight.dtype
            and weight.dtype in PACKABLE_DTYPES
            and not (torch.is_grad_enabled() and weight.requires_grad)
        )

    def _current_key(self) -> tuple:
        key = []
        for lin, slots in zip(self.linears, self._slots, strict=True):
            tensors = lin.quantized_tensors() if self.int8 else _read(lin, slots)
            key += [(p.data_ptr(), tensor_version(p), p.dtype) for p in tensors if p is not None]
        return tuple(key)

    def _pack(self) -> None:
        with torch.no_grad():
            self._weight = self._bias = self._amx = None
            dtype = self.linears[0].weight.dtype
            if onednn_available() and packable_dtype(dtype):
                weight = torch.cat([lin.weight.detach() for lin in self.linears])
                self._weight = torch.ops.mkldnn._reorder_linear_weight(weight)
                biases = [_bias(lin) for lin in self.linears]
                self._bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
                if dtype is torch.bfloat16 and native_amx.available() and _amx_fits(weight):
                    self._amx = native_amx.AmxLinear(weight, self._bias)
            weights = [lin.weight.detach() for lin in self.linears]
            self._build_gemv(weights, [None] * len(weights), weights[0].dtype)
        self._key = self._current_key()


def _amx_fits(weight: torch.Tensor) -> bool:
    return weight.is_cpu and native_amx.fits(*weight.shape)


def _rows(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() == 2 else x.numel() // max(x.shape[-1], 1)


def _all_int8(linears: tuple[nn.Module, ...]) -> bool:
    kinds = {isinstance(lin, Int8Linear) for lin in linears}
    if len(kinds) > 1:  # one matmul over the concatenation: one format
        raise InvariantViolation("a Projection mixes int8 and float layers")
    return kinds == {True}


def _out_features(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, Int8Linear) else layer.weight.shape[0]


def _slots(layer: nn.Module) -> list[tuple[dict | None, str]]:
    """(the parameter dict holding it, or None: read the attribute; name) for a float layer's
    weight and bias, the tensors its packed copies depend on."""
    params = layer._parameters
    return [(params if name in params else None, name) for name in ("weight", "bias")]


def _read(layer: nn.Module, slots: list[tuple[dict | None, str]]) -> list[torch.Tensor | None]:
    return [t.get(name) if t is not None else getattr(layer, name, None) for t, name in slots]


def _bias(layer: nn.Module) -> torch.Tensor | None:
    return getattr(layer, "bias", None)


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def tensor_version(t: torch.Tensor) -> int:
    """t's in-place update counter, for a cache key over (data_ptr, version)."""
    # Tensors made under inference_mode have no version counter; they cannot be updated in place
    # outside it either, so their storage pointer is the key.
    return 0 if t.is_inference() else t._version
