"""The quantized-weight reference: the contiguous generator runs an int8 model through a twin
whose linear layers dequantise explicitly and multiply in plain float32, written here from the
format's definition (kvpage.model.int8's docstring) rather than calling the engine's kernel or
its Projection, so a bug in the int8 matmul path (scales on the wrong axis, a dropped bias, a
stale concatenation) shows up as a divergence instead of being shared by both sides.

  W' = float32(code) * float32(scale)[:, None]     (out, in), once, when the twin is made
  y  = (float32(x) @ W'^T + float32(bias)).to(x's dtype)

The twin is a copy of the model: the same codes and scales (the quantized weights) and the rest
of the model (embeddings, norms, a float head, which keep the engine's layers: the reference
may share model layers, not the int8 path). An int8 LM head (EngineConfig.quantize_lm_head: the
untied `lm_head`, or a tied model's `lm_head_int8` copy beside its float embedding) is an
Int8Linear like the others, so it is dequantised here too. Float models are returned as they
are."""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.model.base import CausalLM
from kvpage.model.int8 import Int8Linear

_twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_model(model: CausalLM) -> CausalLM:
    """`model` itself when no layer is int8; else its dequantising twin (made once per model)."""
    if not any(isinstance(m, Int8Linear) for m in model.modules()):
        return model
    if model not in _twins:
        _twins[model] = _dequantized_twin(model)
    return _twins[model]


class DequantizedLinear(nn.Module):
    """An Int8Linear's weights, dequantised to float32 once; a plain matmul per call."""

    def __init__(self, layer: Int8Linear) -> None:
        super().__init__()
        codes, scales = layer.weight_int8, layer.scales
        self.register_buffer(
            "weight32", codes.to(torch.float32) * scales.to(torch.float32)[:, None]
        )
        bias = layer.bias
        self.register_buffer("bias32", None if bias is None else bias.detach().to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float32) @ self.weight32.T  # (N, out)
        y = y if self.bias32 is None else y + self.bias32
        return y.to(x.dtype)


class _PlainProjection:
    """Called like a Projection: each layer on the shared input, no concatenation; a float
    layer (a tied embedding as LM head too) as x W^T + b."""

    def __init__(self, *layers: nn.Module) -> None:
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_linear(layer, x) for layer in self.layers)


def _linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, DequantizedLinear):
        return layer(x)
    return F.linear(x, layer.weight, getattr(layer, "bias", None))


@torch.no_grad()
def _dequantized_twin(model: CausalLM) -> CausalLM:
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    # Projections are not copied (their packed caches are the engine's); the twin makes its own.
    slots = [(name, attr, p) for name, m in model.named_modules() for attr, p in _projections(m)]
    twin = copy.deepcopy(model, {id(p): None for _, _, p in slots})
    for parent_name, attr, layer in _int8_layers(twin):
        twin.get_submodule(parent_name).register_module(attr, DequantizedLinear(layer))
    for module_name, attr, proj in slots:
        layers = [twin.get_submodule(names[id(lin)]) for lin in proj.linears]
        setattr(twin.get_submodule(module_name), attr, _PlainProjection(*layers))
    return twin


def _projections(module: nn.Module):
    """The module's Projections (kvpage.model.projection), known by their `linears`: the
    reference names no fast-path module, not even to find one."""
    return [(attr, v) for attr, v in vars(module).items() if _is_projection(v)]


def _is_projection(value) -> bool:
    linears = getattr(value, "linears", None)
    return isinstance(linears, tuple) and all(isinstance(m, nn.Module) for m in linears)


def _int8_layers(model: nn.Module):
    return [
        (parent_name, attr, child)
        for parent_name, parent in model.named_modules()
        for attr, child in parent.named_children()
        if isinstance(child, Int8Linear)
    ]
