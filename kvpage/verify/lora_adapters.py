"""The verifier's LoRA adapters: described by a seed and a shape (`LoraSpec`, model-agnostic like
every case), made for the model under test on demand with random A and B large enough to change
greedy tokens. Same spec, same model: the same adapter (same digest)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvpage.config import ModelConfig
from kvpage.lora.adapter import CONFIG_FILE, TARGETS, WEIGHTS_FILE, LoraAdapter

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


def save_peft(spec: LoraSpec, model: ModelConfig, directory: Path) -> Path:
    """`make_adapter(spec, model)` written as a PEFT directory (for engines in other processes:
    server replicas load adapters by path)."""
    adapter = make_adapter(spec, model)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": list(spec.targets),
        "bias": "none",
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    tensors = {}
    for (layer, module), (a, b) in adapter.weights.items():
        block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(directory / WEIGHTS_FILE))
    return directory
