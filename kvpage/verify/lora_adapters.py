"""The verifier's LoRA adapters: described by a seed and a shape (`LoraSpec`, model-agnostic like
every case), made for the model under test on demand with random A and B large enough to change
greedy tokens. Same spec, same model: the same adapter (same digest)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvpage.config import ModelConfig
from kvpage.lora.adapter import TARGETS, LoraAdapter

ALL = TARGETS


@dataclass(frozen=True, slots=True)
class LoraSpec:
    name: str
    seed: int
    targets: tuple[str, ...] = ALL
    rank: int = 4
    alpha: float = 8.0

    @property
    def path(self) -> str:
        """Where the adapter "lives": no directory, the engine is given the adapter itself."""
        return f"builtin:lora/{self.name}/{self.seed}"


def make_adapter(spec: LoraSpec, model: ModelConfig) -> LoraAdapter:
    g = torch.Generator().manual_seed(spec.seed)
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    c, f = model.hidden_size, model.intermediate_size
    fans = {
        "q_proj": (c, q), "k_proj": (c, kv), "v_proj": (c, kv), "o_proj": (q, c),
        "gate_proj": (c, f), "up_proj": (c, f), "down_proj": (f, c),
    }  # fmt: skip
    weights, digest = {}, hashlib.sha256(repr(spec).encode())
    for layer in range(model.num_layers):
        for module in spec.targets:
            fan_in, fan_out = fans[module]
            a = torch.randn(spec.rank, fan_in, generator=g) / fan_in**0.5
            b = torch.randn(fan_out, spec.rank, generator=g) * 0.5
            weights[layer, module] = (a, b)
            digest.update(a.numpy().tobytes() + b.numpy().tobytes())
    scale = spec.alpha / spec.rank
    return LoraAdapter(spec.name, spec.path, spec.rank, scale, weights, digest.hexdigest())
