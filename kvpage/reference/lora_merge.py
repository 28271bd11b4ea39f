"""The reference's LoRA: a copy of the base model with every adapted weight merged,
W' = W + scale * B @ A, computed here in float64 from the adapter's PEFT directory as written.

It reads the directory itself: its own JSON parse of adapter_config.json (r, lora_alpha,
use_rslora, and per-module ranks and alphas: rank_pattern / alpha_pattern, matched to module
names by PEFT's rule written again here) and its own read of adapter_model.safetensors, and shares no code with the engine's
loader (kvpage/lora/adapter.py) nor its low-rank path (kvpage/lora/apply.py, tables.py,
slots.py): a bug in how the engine reads the config (the scale, rsLoRA), pairs the tensors, or
computes the stacked slot tables, the row mask or the sharding shows as a divergence from this
model. A config field it does not implement is refused, never merged as if absent."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from kvpage.model.base import CausalLM
from kvpage.model.loader import build_model
from kvpage.reference.weight_oracle import (
    DequantizedLinear,
    dequantized_copy,
    has_int8_layers,
    with_plain_layers,
)

_OWNER = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}  # fmt: skip
# PEFT's names: base_model.model.{the module's name in the model}.lora_{A|B}.weight, the name
# model.layers.{i}.{self_attn|mlp}.{module} here
_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+))"
    r"\.lora_(A|B)\.weight$"
)
# Fields that change the computation beyond W + scale * B @ A: refused when set.
_NOT_MERGED = (
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "trainable_token_indices",
    "layer_replication",
    "fan_in_fan_out",
)


def adapter_scale(config: dict) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (PEFT's rule)."""
    rank = config["r"]
    alpha = config.get("lora_alpha", rank)
    return alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank


def pattern_value(patterns: dict, module_name: str, default):
    """A module's value in rank_pattern or alpha_pattern as PEFT (peft.utils.other.
    get_pattern_key) finds it: the first pattern, in the file's order, that as a regular
    expression matches the whole module name or a dot-separated tail of it; else `default`."""
    for pattern, value in patterns.items():
        if re.match(r"(.*\.)?(" + pattern + r")$", module_name) is not None:
            return value
    return default


def module_config(config: dict, module_name: str) -> dict:
    """The config as one module sees it: its own r and lora_alpha after the patterns."""
    rank = pattern_value(config.get("rank_pattern") or {}, module_name, config["r"])
    alpha = config.get("lora_alpha", config["r"])
    alpha = pattern_value(config.get("alpha_pattern") or {}, module_name, alpha)
    return {**config, "r": rank, "lora_alpha": alpha}


def read_adapter(directory: str | Path):
    """(config, scale, {(layer, module): (A, B)}, {(layer, module): its scale}) of a PEFT
    directory, read here; `scale` is the config's own (a module no pattern changes)."""
    directory = Path(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("bias", "none") != "none":
        raise ValueError(f"{directory}: the reference merges plain LoRA only")
    for key in _NOT_MERGED:
        if config.get(key):
            raise ValueError(f"{directory}: {key} is set; the reference does not merge it")
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        if match is None or _OWNER.get(match[4]) != match[3]:
            raise ValueError(f"{directory}: tensor {name!r} is not a LoRA factor it merges")
        where = (int(match[2]), match[4])
        halves.setdefault(where, {})[match[5]] = tensor
        names[where] = match["module"]
    factors, scales = {}, {}
    for where, pair in halves.items():
        a, b = pair["A"], pair["B"]
        own = module_config(config, names[where])
        if a.shape[0] != own["r"] or b.shape[1] != own["r"]:
            raise ValueError(f"{directory}: {where} has rank {a.shape[0]}, its r is {own['r']}")
        factors[where] = (a, b)
        scales[where] = adapter_scale(own)
    return config, adapter_scale(config), factors, scales


@torch.no_grad()
def merged_model(model: CausalLM, directory: str | Path) -> CausalLM:
    """A new model: `model` with the adapter at `directory` merged into its weights (the
    original untouched)."""
    _, _, factors, scales = read_adapter(directory)
    if has_int8_layers(model):
        return merged_int8(model, scales, factors)
    # A fresh model of the same config with the same weights: no LoRA context, no packed
    # weight caches of the original's projections.
    merged = build_model(model.config).to(device=model.device, dtype=model.dtype)
    merged.load_state_dict(model.state_dict())
    merged.tie_weights()
    merged.eval()
    deltas = {
        f"model.layers.{index}.{_OWNER[module]}.{module}": scales[index, module]
        * (b.double() @ a.double())
        for (index, module), (a, b) in factors.items()
    }
    if model.dtype in (torch.bfloat16, torch.float16):
        return with_plain_layers(merged, lambda name, layer: _delta_layer(deltas, name, layer))
    for name, delta in deltas.items():
        linear = merged.get_submodule(name)
        linear.weight.copy_((linear.weight.double() + delta).to(linear.weight.dtype))
    return merged


class DeltaLinear(nn.Module):
    """A 16-bit model's adapted layer: its base product in the model's dtype, the adapter's
    dense delta x (scale * B @ A)^T in float32 added to it, the sum rounded once — the numeric
    contract the engine serves (kvpage.lora.tables: the delta accumulated in float32, as
    vLLM's LoRA kernels do), computed here another way (one dense merged delta, no slot
    tables, masks or low-rank products). Merging into 16-bit weights instead rounds the merged
    weight: another model than the base weights plus the delta, whose logits left the engine's
    by more than the dtype's rule on the gate's adapters."""

    def __init__(self, layer: nn.Module, delta: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias = layer.weight, getattr(layer, "bias", None)
        self.register_buffer("delta32", delta.to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return (y.to(torch.float32) + x.to(torch.float32) @ self.delta32.T).to(y.dtype)


def _delta_layer(deltas: dict, name: str, layer: nn.Module) -> DeltaLinear | None:
    return DeltaLinear(layer, deltas[name]) if name in deltas else None


# --- int8 weights ------------------------------------------------------------------------------
# PEFT's model on the dequantised weights: W' = code * scale (kvpage.model.int8's format, written
# again by weight_oracle) plus scale * B @ A, never merged into the codes (that would be another
# model: a requantised W + delta). The engine serves the same contract on its own path: the int8
# product, then x A^T B^T on the activations added to it (kvpage.lora.apply).


class Int8DeltaLinear(DequantizedLinear):
    """An adapted int8 layer: the dequantised product as the quantized reference computes it
    (float32, the output rounded to x's dtype), then the adapter's dense delta x (scale * B @
    A)^T in float32 added and the sum rounded once: in float32 the merged model W' + delta, in
    a 16-bit model the contract DeltaLinear states (one rounding of base + delta on top of the
    base product's own)."""

    def __init__(self, layer: nn.Module, delta: torch.Tensor) -> None:
        super().__init__(layer)
        self.register_buffer("delta32", delta.to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return (y.to(torch.float32) + x.to(torch.float32) @ self.delta32.T).to(x.dtype)


@torch.no_grad()
def merged_int8(model: CausalLM, scales: dict, factors: dict) -> CausalLM:
    """The int8 model's dequantised copy with each adapted layer's delta added (its other
    layers DequantizedLinear, as the quantized reference's); `scales`: each layer's own."""
    deltas = {
        f"model.layers.{index}.{_OWNER[module]}.{module}": scales[index, module]
        * (b.double() @ a.double())
        for (index, module), (a, b) in factors.items()
    }
    merged_into = set()

    def layer(name: str, int8: nn.Module) -> nn.Module:
        delta = deltas.get(name)
        if delta is None:
            return DequantizedLinear(int8)
        merged_into.add(name)
        return Int8DeltaLinear(int8, delta)

    merged = dequantized_copy(model, layer)
    left = sorted(set(deltas) - merged_into)
    if left:  # an adapted layer left float here would lose its delta without a word
        raise ValueError(f"the adapter targets layers that are not int8 here: {left}")
    return merged.eval()
