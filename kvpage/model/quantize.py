"""Turning a loaded model's linear layers into Int8Linear (kvpage.model.int8), in place.

Quantized: every nn.Linear of the decoder layers — attention q/k/v/o (GPT-2's c_attn/c_proj)
and the MLP projections. Kept in the model dtype: the embeddings (a lookup, no matmul to fuse
into), the norms (vectors), and the LM head. The head stays because (1) in tied models (GPT-2)
it *is* the embedding, so quantizing it would quantize the embedding or keep a second copy;
(2) the logits are what sampling and the verifier's tolerances read, and the head's error
lands on them undamped by any later layer; (3) at the vocabularies kvpage runs it is a small
share of the weights."""

from __future__ import annotations

from torch import nn

from kvpage.config import QUANTIZATIONS
from kvpage.errors import InvalidConfig
from kvpage.model.base import CausalLM
from kvpage.model.int8 import Int8Linear, check_supported
from kvpage.model.projection import Projection

KEPT = ("lm_head",)  # linear layers (by attribute name) that stay in the model dtype


def quantize_model_(model: CausalLM, quantization: str) -> CausalLM:
    """Quantize `model` as `quantization` names (QUANTIZATIONS); "none" leaves it as it is."""
    if quantization not in QUANTIZATIONS:
        raise InvalidConfig(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "none":
        return model
    check_supported(model.dtype, model.device)
    swapped = _swap_linears(model)
    _rebuild_projections(model, swapped)
    return model


def weight_quantization(model: nn.Module) -> str:
    """`int8` when any layer of `model` is an Int8Linear, else `none`."""
    return "int8" if any(isinstance(m, Int8Linear) for m in model.modules()) else "none"


def _swap_linears(model: nn.Module) -> dict[int, Int8Linear]:
    """Replace each quantizable nn.Linear; id(old layer) -> its Int8Linear."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and name not in KEPT
    ]
    swapped = {}
    for parent, name, child in targets:
        swapped[id(child)] = Int8Linear.from_linear(child)
        setattr(parent, name, swapped[id(child)])
    return swapped


def _rebuild_projections(model: nn.Module, swapped: dict[int, Int8Linear]) -> None:
    # A Projection holds its layers in a plain tuple (not submodules): point it at the new ones.
    for module in model.modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, Projection):
                layers = [swapped.get(id(lin), lin) for lin in value.linears]
                setattr(module, attr, Projection(*layers))
