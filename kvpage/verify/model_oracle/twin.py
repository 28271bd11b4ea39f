"""The checkpoint transformers runs for the model under test: a Hugging Face directory as it is,
or, for a built-in model (weights made in memory), its Hugging Face twin — the built-in's config
written the way transformers' own class for that shape spells it, and its weights as they are.
Then int8 weights: transformers' model gets each quantised layer's dequantised weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from kvpage.config import ModelConfig
from kvpage.errors import KVPageError
from kvpage.model.base import CausalLM
from kvpage.model.builtin import BUILTIN_PREFIX, SHIPPED_MODELS
from kvpage.model.int8 import Int8Linear


class NoTwin(KVPageError, ValueError):
    """The model has no checkpoint transformers can run on the same weights (the reason)."""


def checkpoint_dir(model_name: str, model: CausalLM, scratch: Path) -> Path:
    """The directory transformers loads: `model_name` itself, a shipped built-in's, or the twin
    of a built-in written under `scratch`."""
    if not model_name.startswith(BUILTIN_PREFIX):
        return Path(model_name)
    name = model_name[len(BUILTIN_PREFIX) :]
    if name in SHIPPED_MODELS:
        return SHIPPED_MODELS[name]
    return write_twin(model, scratch / name)


def write_twin(model: CausalLM, directory: Path) -> Path:
    """`model` (a built-in) as a Hugging Face directory of transformers' class for its shape."""
    cfg = model.config
    hf_cfg = _hf_config(cfg)
    state = _float_state(model)
    if cfg.model_type == "gpt2":  # transformers' Conv1D keeps (in, out)
        state = {k: v.T.contiguous() if _conv1d(k) else v for k, v in state.items()}
        state.pop("lm_head.weight", None)
    elif cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if cfg.qkv_bias is False and isinstance(hf_cfg, transformers.Qwen2Config):
        state |= _zero_qkv_biases(cfg, model.dtype)  # Qwen2's q/k/v always carry a bias
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_cfg.to_dict()))
    save_file(state, str(directory / "model.safetensors"))
    return directory


def _float_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """The state dict with each int8 layer's codes and scales as one dequantised weight."""
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    for name, layer in model.named_modules():
        if isinstance(layer, Int8Linear):
            del state[f"{name}.weight_int8"], state[f"{name}.scales"]
            state[f"{name}.weight"] = _dequantised(layer).to(model.dtype)
    return state


def _dequantised(layer: Int8Linear) -> torch.Tensor:
    return layer.weight_int8.float() * layer.scales.float()[:, None]


def _hf_config(cfg: ModelConfig) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=cfg.vocab_size,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.model_type == "gpt2":
        return transformers.GPT2Config(
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=cfg.intermediate_size,
            n_positions=cfg.max_position_embeddings,
            layer_norm_epsilon=cfg.norm_eps,
            activation_function="gelu_new",
            **common,
        )
    if cfg.model_type != "llama" or cfg.rope is None or cfg.rope.rope_type != "default":
        raise NoTwin(f"no transformers twin for a built-in of type {cfg.model_type!r}")
    if cfg.o_bias or cfg.mlp_bias or cfg.qk_norm:
        raise NoTwin("no transformers twin for a built-in with o/MLP biases or q/k norms")
    shape = dict(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope.theta,
        **common,
    )
    windows = cfg.layer_windows
    if not cfg.qkv_bias and not any(w is not None for w in windows or ()):
        return transformers.LlamaConfig(**shape)
    if len({w for w in windows or () if w is not None}) > 1:
        raise NoTwin("no transformers twin for layers with different window sizes")
    window = next((w for w in windows or () if w is not None), None)
    kinds = [
        "full_attention" if windows is None or w is None else "sliding_attention"
        for w in (windows or [None] * cfg.num_layers)
    ]
    return transformers.Qwen2Config(
        use_sliding_window=window is not None,
        sliding_window=window,
        layer_types=kinds,
        **shape,
    )


def _zero_qkv_biases(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    sizes = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim}
    sizes["v_proj"] = sizes["k_proj"]
    return {
        f"model.layers.{i}.self_attn.{name}.bias": torch.zeros(size, dtype=dtype)
        for i in range(cfg.num_layers)
        for name, size in sizes.items()
    }


# GPT-2's projections, stored by transformers as Conv1D (in, out)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _conv1d(name: str) -> bool:
    return name.endswith(CONV1D)


def load_theirs(directory: Path, dtype: torch.dtype) -> nn.Module:
    """transformers' model from `directory`, by its own loader, in `dtype`, eager attention."""
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def dequantised_into(theirs: nn.Module, ours: CausalLM) -> int:
    """Every int8 layer of `ours` dequantised (code x scale, float32) into the same-named
    layer of `theirs`; the number of layers set. Raises NoTwin where a quantised layer has no
    same-shaped counterpart (a fused checkpoint tensor, a tied head's int8 copy)."""
    their_modules = dict(theirs.named_modules())
    count = 0
    for name, layer in ours.named_modules():
        if not isinstance(layer, Int8Linear):
            continue
        weight = _dequantised(layer)
        target = their_modules.get(name)
        param = getattr(target, "weight", None)
        if param is None:
            raise NoTwin(f"int8 layer {name} has no counterpart in the checkpoint's model")
        if isinstance(target, Conv1D):  # transformers keeps GPT-2's weights (in, out)
            weight = weight.T
        if tuple(param.shape) != tuple(weight.shape):
            raise NoTwin(f"int8 layer {name}: {tuple(weight.shape)} against {tuple(param.shape)}")
        param.copy_(weight.to(param.dtype))
        count += 1
    return count
