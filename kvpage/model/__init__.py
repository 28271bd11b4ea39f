"""Models: `load_model(name_or_path)` -> (model, tokenizer)."""

from __future__ import annotations

import torch

from kvpage.config import MODEL_DTYPES
from kvpage.errors import ModelLoadError, UnknownModel
from kvpage.model.base import CausalLM
from kvpage.model.builtin import (
    BIAS_STD,
    BUILTIN_BIAS_STD,
    BUILTIN_CONFIGS,
    BUILTIN_PREFIX,
    SHIPPED_MODELS,
    builtin_names,
    init_seeded_,
)
from kvpage.model.kernels import finalize
from kvpage.model.loader import build_model, load_hf_directory, load_hf_tokenizer
from kvpage.model.quantize import quantize_model_
from kvpage.model.tokenizer import ByteTokenizer, Tokenizer

# The names are EngineConfig's (MODEL_DTYPES); each is also the torch attribute of its dtype.
DTYPES = {name: getattr(torch, name) for name in MODEL_DTYPES}

__all__ = ["CausalLM", "Tokenizer", "load_model", "load_tokenizer", "resolve_dtype"]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported (supported: {sorted(DTYPES)})")
    return DTYPES[dtype]


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    quantization: str = "none",
    quantize_lm_head: bool = False,
) -> tuple[CausalLM, Tokenizer | None]:
    """`builtin:NAME` or a local Hugging Face directory. The tokenizer is None when the directory
    has no tokenizer.json (token-id prompts still work). `quantization` (EngineConfig's):
    "int8" quantizes the linear layers after loading (kvpage.model.quantize);
    `quantize_lm_head` the LM head too. The model comes bound to its kernels
    (kvpage.model.kernels.finalize, every fast path the environment leaves on)."""
    torch_dtype = resolve_dtype(dtype)
    if name_or_path.startswith(BUILTIN_PREFIX):
        model, tok = _load_builtin(name_or_path[len(BUILTIN_PREFIX) :], torch_dtype, device)
    else:
        model, tok = load_hf_directory(name_or_path, torch_dtype, device)
    return finalize(quantize_model_(model, quantization, quantize_lm_head)), tok


def _load_builtin(name: str, dtype: torch.dtype, device: str) -> tuple[CausalLM, Tokenizer]:
    if name in SHIPPED_MODELS:  # trained weights in the repo's models/ directory
        model, _ = load_hf_directory(SHIPPED_MODELS[name], dtype, device)
        return model, ByteTokenizer()
    if name not in BUILTIN_CONFIGS:
        raise UnknownModel(f"unknown builtin model {name!r} (available: {builtin_names()})")
    model = build_model(BUILTIN_CONFIGS[name])
    init_seeded_(model, bias_std=BUILTIN_BIAS_STD.get(name, BIAS_STD))
    return model.to(device=device, dtype=dtype).eval(), ByteTokenizer()


def load_tokenizer(name_or_path: str) -> Tokenizer | None:
    """The tokenizer alone, for a process that routes prompts but runs no model."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        return ByteTokenizer()  # every builtin model is byte-level
    return load_hf_tokenizer(name_or_path)
