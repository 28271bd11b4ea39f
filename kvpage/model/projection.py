"""Several linear layers over the same input computed as one matmul, on kernels bound once.

Why: a decode step multiplies ~32 rows by each weight. At that shape the plain fp32 GEMM runs at
a third of what oneDNN reaches with a weight reordered once into its blocked layout
(bench/decode_profile.py), and q/k/v (or gate/up) as three (two) small matmuls waste more. The
nn.Linear modules stay the owners of the parameters (checkpoint names, tying, training); the
kernels (kvpage.model.linear_kernels: the weight GEMV and the AMX kernel at few rows, oneDNN's
packed matmul, widened int8/bfloat16 tiles) are bound to them by `bind_kernels`
(kvpage.model.kernels.finalize), which a change of the weights after it must call again. A
call picks among the bound kernels by x's row count alone; torch's F.linear runs where none
takes x (another dtype, autograd) and in an unbound Projection."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import kvpage.model.linear_kernels as linear_kernels
from kvpage.errors import InvariantViolation
from kvpage.model.int8 import Int8Linear
from kvpage.model.kernels import TORCH, KernelChoice
from kvpage.model.linear_kernels import (
    Bound,
    Layers,
    onednn_available,
    onednn_linear,
    packable_dtype,
)

__all__ = ["Projection", "onednn_available", "packable_dtype"]


class Projection:
    """y_1, ..., y_n = x W_1^T + b_1, ..., x W_n^T + b_n for layers that share their input: nn.Linear,
    or any module with a (out, in) `weight` and an optional `bias` (a tied embedding as LM head)."""

    def __init__(self, *linears: nn.Module) -> None:
        # A plain tuple, not submodules: the parameters keep their single checkpoint name.
        self.linears = linears
        self.int8 = _all_int8(linears)
        self.sizes = [_out_features(lin) for lin in linears]
        self.bind_kernels(TORCH)

    def bind_kernels(self, choice: KernelChoice) -> None:
        """The linear kernels `choice` allows that run for the layers' current weights, in
        LINEAR_KERNELS' order."""
        layers = self.layers()
        with torch.no_grad():
            kernels = linear_kernels.LINEAR_KERNELS  # the table, as it is when bound
            bound = [k.bind(layers) for k in kernels if choice.on(k.path)]
        self.bands: tuple[Bound, ...] = tuple(b for b in bound if b is not None)
        self.x_dtype = layers.x_dtype if self.bands else None  # what x the kernels take
        self.packed = next((b.kernel for b in self.bands if b.path == "onednn"), None)
        # Autograd through float weights takes torch's operators (int8 codes do not train).
        self.trainable = not self.int8 and any(w.requires_grad for w in self._weights())

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if torch.is_grad_enabled() and (self.trainable or x.requires_grad):
            return self._plain(x)
        if x.dtype is self.x_dtype:
            rows = x.shape[0] if x.dim() == 2 else _rows(x)
            for band in self.bands:
                if band.lo <= rows <= band.hi:
                    return band.run(x)
        return self._plain(x)

    def layers(self) -> Layers:
        """The layers' current tensors, as the kernels are chosen for them."""
        lins = self.linears
        if self.int8:
            codes, scales, biases = zip(*(lin.quantized_tensors() for lin in lins), strict=True)
            weights, scales = list(codes), list(scales)
            x_dtype = scales[0].dtype
        else:
            weights, scales = [w.detach() for w in self._weights()], [None] * len(lins)
            x_dtype = weights[0].dtype
            biases = [_bias(lin) for lin in lins]
        biases = [None if b is None else b.detach() for b in biases]
        return Layers(weights, scales, biases, self.sizes, x_dtype)

    def native_for(self, rows: int):
        """The native kernel (WeightGemv, AmxLinear) a call on `rows` rows runs, or None."""
        for band in self.bands:
            if band.lo <= rows <= band.hi:
                return band.native
        return None

    def gemv_for(self, x: torch.Tensor):
        """The native kernel a call on x runs (the decode tape records its calls with its own
        output buffers), or None where another path would."""
        return self.native_for(_rows(x)) if x.dtype is self.x_dtype else None

    def packed_unchecked(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T + b, all layers in one (M, sum of sizes) output, on oneDNN's packed weight,
        or None where none is bound (int8, a dtype oneDNN cannot pack, the path off)."""
        return None if self.packed is None else onednn_linear(x, *self.packed)

    def __deepcopy__(self, memo) -> Projection:
        """A copy over the copied layers, bound to torch (the kernels hold raw pointers to these
        layers' tensors); finalize the copy to bind it."""
        return Projection(*(copy.deepcopy(lin, memo) for lin in self.linears))

    def __reduce__(self):
        return (Projection, self.linears)

    def _weights(self) -> list[torch.Tensor]:
        return [] if self.int8 else [lin.weight for lin in self.linears]

    def _plain(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """torch's operators alone; int8 weights dequantised in float32 as the format defines
        them (kvpage.model.int8)."""
        if not self.int8:
            return tuple(F.linear(x, lin.weight, _bias(lin)) for lin in self.linears)
        outs = []
        for lin in self.linears:
            codes, scales, bias = lin.quantized_tensors()
            weight = codes.float() * scales.float()[:, None]
            y = F.linear(x.float(), weight, None if bias is None else bias.float())
            outs.append(y.to(x.dtype))
        return tuple(outs)


def _rows(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() == 2 else x.numel() // max(x.shape[-1], 1)


def _all_int8(linears: tuple[nn.Module, ...]) -> bool:
    kinds = {isinstance(lin, Int8Linear) for lin in linears}
    if len(kinds) > 1:  # one matmul over the concatenation: one format
        raise InvariantViolation("a Projection mixes int8 and float layers")
    return kinds == {True}


def _out_features(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, Int8Linear) else layer.weight.shape[0]


def _bias(layer: nn.Module) -> torch.Tensor | None:
    return getattr(layer, "bias", None)
