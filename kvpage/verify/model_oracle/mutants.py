"""Planted model-math bugs, the model stage's own mutants: each changes one loaded kvpage model
of one family through its public attributes — what a bug in that family's code or config
parsing would leave behind — and is identical on the engine's side and the contiguous
reference's (both run the model), so only transformers can see it. The stage demands that each
is caught on its family's checkpoint and attributed to `model`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kvpage.model.base import CausalLM
from kvpage.model.layers import RotaryEmbedding
from kvpage.verify.mutants.base import replace


@dataclass(frozen=True, slots=True)
class ModelMutant:
    name: str
    bug: str
    family: str  # the checkpoint it is planted in (kvpage.verify.model_oracle.families)
    apply: Callable[[CausalLM], None]
    expected_class: str = "model"
    suites: tuple[str, ...] = ("model",)


def _attention_layers(model: CausalLM):
    return [layer.self_attn for layer in model.model.layers]


def _gemma3_rope_bases_swapped(model: CausalLM) -> None:
    body = model.model
    glob, local = body.rotary, body.local_rotary
    replace(body, "rotary", local)
    replace(body, "local_rotary", glob)


def _nope_flags_inverted(model: CausalLM) -> None:
    for attn in _attention_layers(model):
        replace(attn, "rope_on", not attn.rope_on)


def _llama3_bands_swapped(model: CausalLM) -> None:
    rotary = model.model.rotary
    rope = rotary.rope
    swapped = dataclasses.replace(
        rope, low_freq_factor=rope.high_freq_factor, high_freq_factor=rope.low_freq_factor
    )
    fresh = RotaryEmbedding(swapped, model.config.head_dim).to(rotary.inv_freq.device)
    replace(model.model, "rotary", fresh)


def _k_norm_with_q_weight(model: CausalLM) -> None:
    for attn in _attention_layers(model):
        replace(attn, "k_norm", attn.q_norm)


def _rope_theta_default(model: CausalLM) -> None:
    rotary = model.model.rotary
    fresh = RotaryEmbedding(dataclasses.replace(rotary.rope, theta=10000.0), model.config.head_dim)
    replace(model.model, "rotary", fresh)


def _window_off_by_one(model: CausalLM) -> None:
    for attn in _attention_layers(model):
        if attn.window is not None:
            replace(attn, "window", attn.window + 1)


MODEL_MUTANTS: tuple[ModelMutant, ...] = (
    ModelMutant(
        "gemma3_rope_bases_swapped",
        "Gemma 3's local layers rotate with the global RoPE base and the global with the local",
        "gemma3",
        _gemma3_rope_bases_swapped,
    ),
    ModelMutant(
        "nope_layers_inverted",
        "SmolLM3's no_rope_layers read inverted: RoPE on the NoPE layers and off on the others",
        "smollm3",
        _nope_flags_inverted,
    ),
    ModelMutant(
        "llama3_rope_bands_swapped",
        "llama3 RoPE scaling with low_freq_factor and high_freq_factor swapped",
        "llama-rope-llama3",
        _llama3_bands_swapped,
    ),
    ModelMutant(
        "qwen3_k_norm_uses_q_weight",
        "Qwen3's k normed with q_norm's weight",
        "qwen3",
        _k_norm_with_q_weight,
    ),
    ModelMutant(
        "rope_theta_ignored",
        "the config's rope_theta ignored: the default base 10000 where Qwen2 sets 1e6",
        "qwen2-bias",
        _rope_theta_default,
    ),
    ModelMutant(
        "sliding_window_off_by_one",
        "a sliding window one key wider than the config's (p - W .. p)",
        "mistral-window",
        _window_off_by_one,
    ),
)
