"""kvpage's forward against transformers' on the same checkpoint, layer by layer: each decoder
layer's output (the residual stream) and the logits, over whole sequences of several lengths,
in one dtype. kvpage's side is the reference's own forward (torch's kernels only,
kvpage.model.kernels); transformers read the checkpoint with their own loader and config
parser, so what this compares is everything kvpage does from the directory to the logits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from kvpage.model.base import CausalLM
from kvpage.model.kernels import torch_twin
from kvpage.verify.diff import logit_atol


@dataclass(frozen=True, slots=True)
class LayerGap:
    """The first place kvpage's forward leaves transformers' tolerance at one length."""

    length: int
    where: str  # "layer 3" | "logits"
    layer: int  # -1 for the logits (every layer agreed)
    layer_kind: str  # "sliding window 12", "global", "global, no RoPE", "head"
    max_abs_diff: float
    tolerance: float


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder stack of a kvpage or a transformers causal LM (Llama-shaped or GPT-2)."""
    if hasattr(model, "get_base_model"):  # PEFT's wrapper: its LoRA layers sit in the base
        model = model.get_base_model()
    for path in ("model.layers", "transformer.h", "model.language_model.layers"):
        owner = model
        for part in path.split("."):
            owner = getattr(owner, part, None)
            if owner is None:
                break
        if isinstance(owner, nn.ModuleList):
            return owner
    raise TypeError(f"{type(model).__name__}: no decoder stack found")


@contextmanager
def layer_outputs(layers: nn.ModuleList) -> Iterator[list[torch.Tensor]]:
    """Each layer's output as (T, C) float32, in layer order, while the block runs."""
    outs: list[torch.Tensor] = []

    def keep(_module, _args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if _hidden_and_residual(output):  # kvpage's Llama layers: the stream is their sum
            hidden = output[1] + output[0]
        outs.append(hidden.detach().reshape(-1, hidden.shape[-1]).float().cpu())

    handles = [layer.register_forward_hook(keep) for layer in layers]
    try:
        yield outs
    finally:
        for handle in handles:
            handle.remove()


def _hidden_and_residual(output) -> bool:
    """(hidden, residual) of one shape: vLLM's layer output (kvpage.model.llama); transformers'
    layers return the stream itself (or with attention weights of another shape)."""
    if not isinstance(output, tuple) or len(output) != 2:
        return False
    a, b = output
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape


def layer_kind(model: CausalLM, layer: int) -> str:
    cfg = model.config
    window = cfg.window_of(layer)
    kind = "global" if window is None else f"sliding window {window}"
    if cfg.rope is not None and not cfg.rope_on(layer):
        kind += ", no RoPE"
    return kind


@torch.inference_mode()
def first_gap(
    ours: CausalLM, theirs: nn.Module, ids: list[int], dtype: torch.dtype
) -> LayerGap | None:
    """None when every layer and the logits agree within the dtype's tolerance (relative to the
    magnitude of transformers' values, kvpage.verify.diff.logit_atol), else the first that
    does not."""
    ours = torch_twin(ours)  # torch's operators: the model's math, not the engine's kernels
    with layer_outputs(decoder_layers(ours)) as our_layers:
        our_logits = ours.forward_full(ids).float()
    with layer_outputs(decoder_layers(theirs)) as their_layers:
        device = next(theirs.parameters()).device
        their_logits = theirs(torch.tensor([ids], device=device)).logits[0].float()
    pairs = list(zip(our_layers, their_layers, strict=True))
    for i, (a, b) in enumerate(pairs):
        gap = _gap(a, b, dtype)
        if gap is not None:
            return LayerGap(len(ids), f"layer {i}", i, layer_kind(ours, i), *gap)
    gap = _gap(our_logits.cpu(), their_logits.cpu(), dtype)
    if gap is not None:
        return LayerGap(len(ids), "logits", -1, "final norm and LM head", *gap)
    return None


def _gap(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype):
    if ours.shape != theirs.shape:
        return float("inf"), 0.0
    tolerance = logit_atol("auto", dtype, float(theirs.abs().max()))
    diff = float((ours - theirs).abs().max())
    return None if diff <= tolerance else (diff, tolerance)
