"""Built-in models that need nothing downloaded: fixed configs, seeded random weights built in memory,
the byte-level tokenizer. Weights are scaled so logits are well separated, which keeps greedy
decoding stable across kernels (random HF-style 0.02 init gives near-ties everywhere)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvpage.config import ModelConfig, RopeConfig
from kvpage.model.tokenizer import ByteTokenizer

BUILTIN_PREFIX = "builtin:"
_BYTES = ByteTokenizer()


def _tiny(name: str, **fields) -> ModelConfig:
    """A built-in config: the byte tokenizer's vocabulary and special tokens, a revision naming
    the model, and tiny-llama's shape, with `fields` over them."""
    shape = dict(
        model_type="llama",
        vocab_size=_BYTES.vocab_size,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,  # GQA
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=4096,
        norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        bos_token_id=_BYTES.bos_token_id,
        eos_token_ids=(_BYTES.eos_token_id,),
        revision=f"{BUILTIN_PREFIX}{name}@seed0",
    )
    return ModelConfig(**(shape | fields))


# What each built-in model changes of tiny-llama's shape.
_BUILTIN_SHAPES: dict[str, dict] = {
    "tiny-llama": {},
    "tiny-gpt2": dict(
        model_type="gpt2",
        num_kv_heads=4,
        intermediate_size=256,
        max_position_embeddings=2048,
        norm_eps=1e-5,
        rope=None,
        tie_word_embeddings=True,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
    ),
    # Qwen2's shape where tiny-llama has none: head_dim 64 (kernels and KV layouts that only
    # exist at head_dim >= 32) and biases on q/k/v (not on o). Loads into transformers'
    # Qwen2ForCausalLM unchanged (tests/model/test_builtin_qwen2.py).
    "tiny-qwen2": dict(
        hidden_size=128,
        num_kv_heads=2,  # GQA, and divisible by a TP size of 2
        head_dim=64,  # num_heads * head_dim = 256 != hidden_size: q/o are not square
        intermediate_size=256,
        rope=RopeConfig(theta=1000000.0),
        qkv_bias=True,
    ),
    # Hybrid attention (kvpage.cache.groups): 1 global : 2 sliding-window layers, a window of
    # 12 keys, so 8- and 16-token blocks fall out of it within a short decode.
    "tiny-hybrid": dict(num_layers=3, layer_windows=(12, 12, None)),
}
BUILTIN_CONFIGS: dict[str, ModelConfig] = {
    name: _tiny(name, **fields) for name, fields in _BUILTIN_SHAPES.items()
}

# Bias scale per model (default BIAS_STD). Qwen2 checkpoints carry large q/k biases; at the
# default 0.02 a path that dropped or double-added a bias would move logits by less than the
# float32 tolerance and no case could see it.
BIAS_STD = 0.02
BUILTIN_BIAS_STD: dict[str, float] = {"tiny-qwen2": 0.5}

# Trained byte-level models shipped as Hugging Face directories (the repo is installed editable).
SHIPPED_MODELS: dict[str, Path] = {
    "passphrase-mini": Path(__file__).resolve().parents[2] / "models" / "passphrase-mini",
}

BUILTIN_SEED = 0
LM_HEAD_SCALE = 2.5  # logits std ~2.5: clear greedy winners, sampling still has entropy


def builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + name for name in (*BUILTIN_CONFIGS, *SHIPPED_MODELS)]


def init_seeded_(
    model: torch.nn.Module, seed: int = BUILTIN_SEED, bias_std: float = BIAS_STD
) -> None:
    """Deterministic weights, independent of the global RNG: matrices ~ N(0, 1/fan_in),
    embeddings ~ N(0, 1) (a tied GPT-2 wte smaller), biases ~ N(0, bias_std), norm weights 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(_seeded_value(name, param, gen, bias_std).to(param.dtype))


def _seeded_value(
    name: str, param: torch.Tensor, gen: torch.Generator, bias_std: float
) -> torch.Tensor:
    shape = tuple(param.shape)
    if "norm" in name or "ln_" in name:
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    if name.endswith("bias"):
        return torch.randn(shape, generator=gen) * bias_std
    if name.endswith("wte.weight"):  # also the tied output head: keep logits at unit scale
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1]) * 2
    if param.dim() == 2 and ("embed" in name or "wpe" in name):
        return torch.randn(shape, generator=gen)
    scale = LM_HEAD_SCALE if name == "lm_head.weight" else 1.0
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1]) * scale
