"""Small random-weight checkpoints of every family kvpage serves, made by transformers itself:
the configs (each layer kind, windows shorter than the prompts, tied and untied heads, every RoPE
scaling kvpage implements, fused Phi-3 tensors, NoPE layers, q/k norms), saved with
`save_pretrained` and loaded back through kvpage's own loader. The gate's model stage compares
kvpage's forward with transformers' on them (kvpage.verify.model_oracle.stage), and the
repository's model tests use the same checkpoints."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers

FAMILY_SEED = 1234
VOCAB = 320
# HF's default init (std 0.02) leaves logits nearly tied, so greedy parity would hinge on rounding;
# a wider init keeps the comparison about the model, not about ties.
INIT_STD = 0.15


def _config(cls, **fields):
    """A small config of `cls`: the fields every test model shares, then `fields` over them."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=INIT_STD,
        bos_token_id=1,
        eos_token_id=2,
    )
    return cls(**(base | fields))


def _llama(**kw):
    return _config(transformers.LlamaConfig, **({"num_key_value_heads": 4} | kw))


def _qwen2(**kw):
    # Qwen2's own RoPE base (transformers' default is Llama's 10000): a config reader that
    # dropped it would go unseen at the default.
    return _config(transformers.Qwen2Config, **({"rope_theta": 1000000.0} | kw))


def _mistral(**kw):
    return _config(transformers.MistralConfig, **kw)


def _qwen3(**kw):
    # Qwen3 sets head_dim apart from hidden_size / heads.
    return _config(transformers.Qwen3Config, **({"head_dim": 24} | kw))


def _smollm3(**kw):
    # Every 2nd layer without RoPE: layers 1 and 3 of 4.
    fields = dict(num_hidden_layers=4, no_rope_layer_interval=2, pad_token_id=0)
    return _config(transformers.SmolLM3Config, **(fields | kw))


def _phi3(**kw):
    fields = dict(original_max_position_embeddings=512, pad_token_id=0)
    return _config(transformers.Phi3Config, **(fields | kw))


def _gemma3(**kw):
    fields = dict(
        num_hidden_layers=3,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        pad_token_id=0,
    )
    return _config(transformers.Gemma3TextConfig, **(fields | kw))


def _gpt2():
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        initializer_range=INIT_STD,
        bos_token_id=1,
        eos_token_id=2,
    )


FAMILY_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama-mha": lambda: _llama(),
    "llama-gqa-8q-2kv": lambda: _llama(
        hidden_size=128, num_attention_heads=8, num_key_value_heads=2
    ),
    "llama-mqa": lambda: _llama(num_key_value_heads=1),
    "llama-rope-linear-2": lambda: _llama(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-rope-llama3": lambda: _llama(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    "llama-tied": lambda: _llama(tie_word_embeddings=True),
    # Llama 3.2's shape: tied head and llama3 rope scaling together.
    "llama3.2": lambda: _llama(
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    # SmolLM3: every 4th layer without RoPE (NoPE), tied head.
    "smollm3": lambda: _smollm3(),
    "qwen2-bias": _qwen2,
    # Sliding windows shorter than the test prompts: every layer (Mistral), or the layers from
    # max_window_layers on (Qwen2: layer 0 global, layer 1 windowed).
    "mistral-window": lambda: _mistral(sliding_window=24),
    "qwen2-window": lambda: _qwen2(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "qwen3": _qwen3,
    "qwen3-tied": lambda: _qwen3(tie_word_embeddings=True),
    # Phi-3: fused qkv_proj / gate_up_proj checkpoints; Phi-4-mini's partial rotary, tied head.
    "phi3": _phi3,
    "phi3-partial-tied": lambda: _phi3(partial_rotary_factor=0.5, tie_word_embeddings=True),
    # Gemma 3 text: 1 global : 2 local layers (window 12), local and global RoPE bases.
    "gemma3": _gemma3,
    "gpt2": _gpt2,
}


def build_family(name: str, seed: int = FAMILY_SEED) -> transformers.PreTrainedModel:
    """Family `name` with transformers' own seeded random init (the global RNG untouched)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        cfg = FAMILY_CONFIGS[name]()
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        if name in PERTURBED_NORMS:
            _perturb_norms(model)
    return model.float().eval()


# Norm weights start at 1 everywhere; for these, each gets its own values, so a norm applied in
# the wrong place (q's to k, before instead of after a reshape) changes the logits.
PERTURBED_NORMS = ("qwen3", "qwen3-tied", "gemma3")


def _perturb_norms(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))


def save_family(name: str, directory, **save_kw) -> transformers.PreTrainedModel:
    """Family `name` written as a Hugging Face directory by transformers; the model returned."""
    model = build_family(name)
    model.save_pretrained(directory, **save_kw)
    return model
