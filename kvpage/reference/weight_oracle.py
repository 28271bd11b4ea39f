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
Int8Linear like the others, so it is dequantised here too. A float model's reference is its
torch twin (kvpage.model.kernels.torch_twin: the same weight tensors); either twin is bound to
torch's operators only, never a fast path of the engine's."""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.model.base import CausalLM
from kvpage.model.int8 import Int8Linear
from kvpage.model.kernels import TORCH, finalize, torch_twin

_twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_model(model: CausalLM) -> CausalLM:
    """`model`'s torch twin when no layer is int8; else its dequantising twin (made once per
    model); both bound to torch's operators only."""
    if not has_int8_layers(model):
        return torch_twin(model)
    if model not in _twins:
        _twins[model] = finalize(_dequantized_twin(model), TORCH)
    return _twins[model]


def has_int8_layers(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


class Float32Linear(nn.Module):
    """y = (float32(x) @ W^T + b).to(x's dtype) on float32 weights kept as they are: one
    rounding of the output, none of the weights (a merged adapter's W + scale * B @ A in a
    16-bit model, an int8 layer's dequantised codes)."""

    def __init__(self, weight32: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight32", weight32.detach().to(torch.float32))
        self.register_buffer("bias32", None if bias is None else bias.detach().to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float32) @ self.weight32.T  # (N, out)
        y = y if self.bias32 is None else y + self.bias32
        return y.to(x.dtype)


class DequantizedLinear(Float32Linear):
    """An Int8Linear's weights, dequantised to float32 once; a plain matmul per call."""

    def __init__(self, layer: Int8Linear) -> None:
        codes, scales = layer.weight_int8, layer.scales
        super().__init__(codes.to(torch.float32) * scales.to(torch.float32)[:, None], layer.bias)


class _PlainProjection:
    """Called like a Projection: each layer on the shared input, no concatenation; a float
    layer (a tied embedding as LM head too) as x W^T + b."""

    def __init__(self, *layers: nn.Module) -> None:
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_linear(layer, x) for layer in self.layers)


def _linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, (nn.Linear, nn.Embedding)):  # a tied embedding as LM head too
        return F.linear(x, layer.weight, getattr(layer, "bias", None))
    return layer(x)  # a replacement's own forward (Float32Linear, a merged adapter's layer)


def _dequantized_twin(model: CausalLM) -> CausalLM:
    return dequantized_copy(model, lambda _name, layer: DequantizedLinear(layer))


@torch.no_grad()
def dequantized_copy(model: CausalLM, int8_layer) -> CausalLM:
    """A copy of an int8 model, each Int8Linear replaced by `int8_layer(name, layer)` (a module
    computing from the layer's codes and scales in plain float: DequantizedLinear, or a merged
    adapter's layer, kvpage.reference.lora_merge), every Projection a plain one. An adapter
    context the engine attached (`lora`) is left out: the copy computes its own layers only."""
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    # Projections are not copied (their packed caches are the engine's); the twin makes its own.
    slots = [(name, attr, p) for name, m in model.named_modules() for attr, p in _projections(m)]
    memo = {id(p): None for _, _, p in slots}
    memo.update({id(m.__dict__["lora"]): None for m in model.modules() if "lora" in m.__dict__})
    twin = copy.deepcopy(model, memo)

    def replaced(name: str, layer: nn.Module) -> nn.Module | None:
        return int8_layer(name, layer) if isinstance(layer, Int8Linear) else None

    return _rebuilt(twin, names, slots, replaced)


@torch.no_grad()
def with_plain_layers(model: CausalLM, replacement) -> CausalLM:
    """`model` itself (its caller's own copy), each layer for which `replacement(name, layer)`
    gives a module replaced by it, and every Projection a plain one over the layers (torch's
    F.linear, or the replacement's own forward)."""
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    slots = [(name, attr, p) for name, m in model.named_modules() for attr, p in _projections(m)]
    return _rebuilt(model, names, slots, replacement)


def _rebuilt(model: CausalLM, names: dict, slots: list, replacement) -> CausalLM:
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            new = replacement(f"{parent_name}.{attr}" if parent_name else attr, child)
            if new is not None:
                parent.register_module(attr, new)
    for module_name, attr, proj in slots:
        layers = [model.get_submodule(names[id(lin)]) for lin in proj.linears]
        setattr(model.get_submodule(module_name), attr, _PlainProjection(*layers))
    return model


def _projections(module: nn.Module):
    """The module's Projections (kvpage.model.projection), known by their `linears`: the
    reference names no fast-path module, not even to find one."""
    return [(attr, v) for attr, v in vars(module).items() if _is_projection(v)]


def _is_projection(value) -> bool:
    linears = getattr(value, "linears", None)
    return isinstance(linears, tuple) and all(isinstance(m, nn.Module) for m in linears)
