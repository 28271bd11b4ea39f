"""Turning a loaded model's linear layers into Int8Linear (kvpage.model.int8), in place.

Quantized: every nn.Linear of the decoder layers — attention q/k/v/o (GPT-2's c_attn/c_proj)
and the MLP projections. Kept in the model dtype: the embeddings (a lookup, no matmul to fuse
into), the norms (vectors), and, by default, the LM head. The head stays unless asked for
(`lm_head=True`, EngineConfig.quantize_lm_head) because (1) in tied models (GPT-2, Llama 3.2)
it *is* the embedding; (2) the logits are what sampling and the verifier's tolerances read, and
the head's error lands on them undamped by any later layer. Asked for, it is the same
per-output-channel format: at a 32k vocabulary and d=768 the head is 24.6M of the 125m bench
model's weights, the largest single read of a batch-1 decode step (llama.cpp's Q8_0 quantizes
it too).

A quantized head of an untied model replaces its `lm_head` in place. A tied model keeps its
embedding (and a tied `lm_head` that shares it) in the model dtype, for the lookup, and holds an
int8 copy of the same matrix as `lm_head_int8` for the logits: the head's codes and scales are
its own buffers, so the embedding rows a token looks up are never rounded."""

from __future__ import annotations

from torch import nn

from kvpage.config import QUANTIZATIONS
from kvpage.errors import InvalidConfig
from kvpage.model.base import CausalLM
from kvpage.model.int8 import Int8Linear, check_supported
from kvpage.model.projection import Projection

KEPT = ("lm_head",)  # linear layers (by attribute name) that stay in the model dtype by default
TIED_HEAD = "lm_head_int8"  # a tied model's int8 copy of its head (the embedding stays float)


def quantize_model_(model: CausalLM, quantization: str, lm_head: bool = False) -> CausalLM:
    """Quantize `model` as `quantization` names (QUANTIZATIONS); "none" leaves it as it is.
    `lm_head`: the LM head too (needs "int8")."""
    if quantization not in QUANTIZATIONS:
        raise InvalidConfig(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if lm_head and quantization != "int8":
        raise InvalidConfig(
            f"quantize_lm_head must be False unless quantization is 'int8', got True with "
            f"quantization {quantization!r}"
        )
    if quantization == "none":
        return model
    check_supported(model.dtype, model.device)
    swapped = _swap_linears(model)
    _rebuild_projections(model, swapped)
    if lm_head:
        _quantize_head(model)
    return model


def weight_quantization(model: nn.Module) -> str:
    """`int8` when any layer of `model` is an Int8Linear, else `none`."""
    return "int8" if any(isinstance(m, Int8Linear) for m in model.modules()) else "none"


def head_quantized(model: nn.Module) -> bool:
    """Whether `model` computes its logits with an int8 head."""
    logits = getattr(model, "logits", None)
    return isinstance(logits, Projection) and logits.int8


def state_quantization(state: dict) -> tuple[str, bool]:
    """(quantization, lm_head) of the model a state dict was taken from (a tensor-parallel rank
    rebuilds that structure before loading the state)."""
    int8 = any(k.endswith(".weight_int8") for k in state)
    head = any(k in ("lm_head.weight_int8", f"{TIED_HEAD}.weight_int8") for k in state)
    return ("int8" if int8 else "none"), head


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


def _quantize_head(model: CausalLM) -> None:
    """The layer `model.logits` computes with, as an Int8Linear (see the module docstring)."""
    (head,) = model.logits.linears
    if isinstance(head, Int8Linear):
        return
    quantized = Int8Linear.from_weight(head.weight, getattr(head, "bias", None))
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if isinstance(head, nn.Linear) and id(head.weight) not in embeddings:
        model.lm_head = quantized  # untied: the float head is dropped
    else:
        model.register_module(TIED_HEAD, quantized)  # tied: the embedding stays float
    model.logits = Projection(quantized)
