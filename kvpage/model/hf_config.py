"""Hugging Face config.json -> ModelConfig. Reads both dialects: the older one with `rope_theta` and
`rope_scaling` at the top level, and transformers 5's `rope_parameters` object."""

from __future__ import annotations

from typing import Any

from kvpage.config import ModelConfig, RopeConfig
from kvpage.errors import UnsupportedModel

LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mistral", "phi3", "smollm3")
SUPPORTED_MODEL_TYPES = (*LLAMA_LIKE, "gemma3_text", "gpt2")


def parse_hf_config(cfg: dict[str, Any], revision: str = "") -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
        )
    if model_type == "gpt2":
        return _parse_gpt2(cfg, revision)
    if model_type == "gemma3_text":
        return _parse_gemma3(cfg, revision)
    return _parse_llama_like(cfg, model_type, revision)


def _parse_llama_like(cfg: dict[str, Any], model_type: str, revision: str) -> ModelConfig:
    _refuse_unsupported_fields(cfg, model_type)
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    is_qwen2 = model_type == "qwen2"
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        model_type="llama",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=parse_rope(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four.
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        checkpoint_family=model_type,
        layer_windows=layer_windows(cfg, model_type),
        nope_layers=nope_layers(cfg),
        bos_token_id=_single_id(cfg.get("bos_token_id")),
        eos_token_ids=_id_tuple(cfg.get("eos_token_id")),
        revision=revision,
    )


def nope_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's `no_rope_layers` (one flag per layer, 0: no RoPE) as the NoPE layers' indices."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        return ()
    n = cfg["num_hidden_layers"]
    if len(flags) != n or any(f not in (0, 1) for f in flags):
        raise UnsupportedModel(f"no_rope_layers must be {n} flags of 0 or 1, got {flags}")
    return tuple(i for i, use_rope in enumerate(flags) if not use_rope)


def _parse_gemma3(cfg: dict[str, Any], revision: str) -> ModelConfig:
    _refuse_unsupported_fields(cfg, "gemma3_text", act_field="hidden_activation")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel("gemma3_text config: use_bidirectional_attention is not supported")
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        model_type="gemma3",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=parse_rope(cfg, "full_attention", default_theta=1_000_000.0),
        local_rope=parse_rope(cfg, "sliding_attention", default_theta=10_000.0, local=True),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        checkpoint_family="gemma3_text",
        layer_windows=layer_windows(cfg, "gemma3_text"),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        bos_token_id=_single_id(cfg.get("bos_token_id")),
        eos_token_ids=_id_tuple(cfg.get("eos_token_id")),
        revision=revision,
    )


def _refuse_unsupported_fields(
    cfg: dict[str, Any], model_type: str, act_field: str = "hidden_act"
) -> None:
    """Fields that change what the model computes and that this architecture does not
    implement: refused by name, never silently run as if absent."""
    problems = []
    kinds = set(cfg.get("layer_types") or ()) - set(LAYER_KINDS)
    if kinds:
        problems.append(f"layer_types with {sorted(kinds)} (supported: {LAYER_KINDS})")
    supported = "gelu_pytorch_tanh" if model_type == "gemma3_text" else "silu"
    act = cfg.get(act_field, supported)
    if act != supported:
        problems.append(f"{act_field}={act!r} (supported: {supported!r})")
    if model_type != "phi3" and _partial_rotary(cfg) != 1.0:
        problems.append(f"partial_rotary_factor={_partial_rotary(cfg)} (in {model_type})")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(name) is not None:
            problems.append(f"{name}={cfg[name]}")
    if problems:
        raise UnsupportedModel(f"{model_type} config: not supported: " + "; ".join(problems))


LAYER_KINDS = ("full_attention", "sliding_attention")


def layer_windows(cfg: dict[str, Any], model_type: str) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global), as transformers applies them: `layer_types`
    when the config has them; else Mistral and Phi-3 window every layer when `sliding_window`
    is set, Qwen2/3 the layers from `max_window_layers` on when `use_sliding_window`. A window
    no position can outgrow (>= max_position_embeddings) is no window. Empty: all global."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    kinds = cfg.get("layer_types")
    if window is not None and not kinds:
        if model_type == "gemma3_text":  # the older dialect's pattern: every Nth layer global
            every = cfg.get("sliding_window_pattern", 6)
            kinds = [
                "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)
            ]
        elif model_type in ("mistral", "phi3"):
            kinds = ["sliding_attention"] * n
        elif model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            first = cfg.get("max_window_layers", n)
            kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if not kinds or window is None or window >= cfg.get("max_position_embeddings", 2**31):
        if kinds and "sliding_attention" in kinds and window is None:
            raise UnsupportedModel(f"{model_type} config: sliding layers but no sliding_window")
        return ()
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def _parse_gpt2(cfg: dict[str, Any], revision: str) -> ModelConfig:
    if cfg.get("activation_function", "gelu_new") != "gelu_new":
        raise UnsupportedModel(
            f"gpt2 activation_function {cfg['activation_function']!r} is not supported "
            "(supported: 'gelu_new')"
        )
    if cfg.get("scale_attn_weights", True) is False:
        raise UnsupportedModel("gpt2 with scale_attn_weights=false is not supported")
    hidden = cfg["n_embd"]
    heads = cfg["n_head"]
    return ModelConfig(
        model_type="gpt2",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=cfg["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        max_position_embeddings=cfg.get("n_positions", 1024),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        rope=None,
        tie_word_embeddings=True,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        scale_attn_by_inverse_layer_idx=bool(cfg.get("scale_attn_by_inverse_layer_idx", False)),
        bos_token_id=_single_id(cfg.get("bos_token_id")),
        eos_token_ids=_id_tuple(cfg.get("eos_token_id")),
        revision=revision,
    )


def _partial_rotary(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))


def parse_rope(
    cfg: dict[str, Any],
    layer_type: str = "full_attention",
    default_theta: float = 10000.0,
    local: bool = False,
) -> RopeConfig:
    """The RoPE of `layer_type` layers. Older dialect: `rope_theta` and `rope_scaling` at the top
    level (Gemma 3's local layers: `rope_local_base_freq`, unscaled)."""
    params = cfg.get("rope_parameters")
    if params is None:  # older dialect
        if local:
            params = {"rope_theta": cfg.get("rope_local_base_freq", default_theta)}
        else:
            params = dict(cfg.get("rope_scaling") or {})
            params.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    if isinstance(params.get(layer_type), dict):
        params = params[layer_type]  # per-layer-type form
    elif isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return RopeConfig(
        theta=float(params.get("rope_theta", cfg.get("rope_theta", default_theta))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings", 8192)
        ),
        partial_rotary_factor=_partial_rotary(cfg),
    )


def _single_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _id_tuple(value: Any) -> tuple[int, ...]:
    """HF allows one EOS id or a list of them (Llama 3 ends turns with several)."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
