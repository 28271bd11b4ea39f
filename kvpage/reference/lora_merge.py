"""The reference's LoRA: a copy of the base model with every adapted weight merged,
W' = W + scale * B @ A, computed here in float64 from the adapter's tensors. It shares no code
with the engine's low-rank path (kvpage/lora/apply.py, tables.py, slots.py): a bug in the stacked
slot tables, the row mask, the sharding or the scale shows as a divergence from this model."""

from __future__ import annotations

import torch

from kvpage.lora.adapter import LoraAdapter
from kvpage.model.base import CausalLM
from kvpage.model.loader import build_model

_OWNER = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}  # fmt: skip


@torch.no_grad()
def merged_model(model: CausalLM, adapter: LoraAdapter) -> CausalLM:
    """A new model: `model` with `adapter` merged into its weights (the original untouched)."""
    # A fresh model of the same config with the same weights: no LoRA context, no packed
    # weight caches of the original's projections.
    merged = build_model(model.config).to(device=model.device, dtype=model.dtype)
    merged.load_state_dict(model.state_dict())
    merged.tie_weights()
    merged.eval()
    for (index, module), (a, b) in adapter.weights.items():
        linear = getattr(getattr(merged.model.layers[index], _OWNER[module]), module)
        delta = adapter.scale * (b.double() @ a.double())
        linear.weight.copy_((linear.weight.double() + delta).to(linear.weight.dtype))
    return merged
