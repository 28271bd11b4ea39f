"""A local Hugging Face directory -> (model, tokenizer): config.json, one or several *.safetensors
(with model.safetensors.index.json when sharded), tokenizer.json when present."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvpage.config import ModelConfig
from kvpage.errors import ConfigNotFound, MissingWeight, UnknownModel, WeightShapeMismatch
from kvpage.model.base import CausalLM
from kvpage.model.fused_weights import FusedRows, fused_source
from kvpage.model.gemma3 import Gemma3ForCausalLM
from kvpage.model.gpt2 import CONV1D_SUFFIXES, GPT2LMHeadModel
from kvpage.model.hf_config import parse_hf_config
from kvpage.model.llama import LlamaForCausalLM
from kvpage.model.tokenizer import HFTokenizer

INDEX_FILE = "model.safetensors.index.json"
# Checkpoints saved from the bare model (LlamaModel, GPT2Model) lack the head-model prefix.
OPTIONAL_PREFIXES = ("model.", "transformer.")


FAMILIES = {"gpt2": GPT2LMHeadModel, "gemma3": Gemma3ForCausalLM, "llama": LlamaForCausalLM}


def build_model(cfg: ModelConfig) -> CausalLM:
    return FAMILIES[cfg.model_type](cfg)


def read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigNotFound(f"no config.json in {directory}")
    raw = path.read_bytes()
    # The revision names these exact weights+config for the cache namespace.
    return parse_hf_config(json.loads(raw), revision=_revision(directory, raw))


def load_hf_directory(
    directory: str | Path, dtype: torch.dtype, device: str
) -> tuple[CausalLM, HFTokenizer | None]:
    directory = Path(directory)
    if not directory.is_dir():
        raise UnknownModel(f"{directory} is not a directory (nor a builtin:NAME model)")
    cfg = read_config(directory)
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    _load_weights(model, _tensor_locations(directory))
    model.eval()
    return model, _load_tokenizer(directory, cfg)


def _tensor_locations(directory: Path) -> dict[str, Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise MissingWeight(f"no *.safetensors file in {directory}")
    locations: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            locations.update(dict.fromkeys(f.keys(), file))
    return locations


def _load_weights(model: CausalLM, locations: dict[str, Path]) -> None:
    conv1d = model.config.model_type == "gpt2"
    by_file: dict[Path, list[tuple[str, str, FusedRows | None, torch.Tensor]]] = {}
    for name, param in _unique_parameters(model):
        fused = fused_source(model.config, name)
        ckpt_name = _find_checkpoint_name(name if fused is None else fused.name, locations)
        by_file.setdefault(locations[ckpt_name], []).append((name, ckpt_name, fused, param))
    for file, entries in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name, ckpt_name, fused, param in entries:
                tensor = _read(f, ckpt_name, fused)
                transpose = conv1d and name.endswith(CONV1D_SUFFIXES)
                where = ckpt_name if fused is None else f"{ckpt_name}[{fused.start}:{fused.stop}]"
                _copy_checked(param, tensor, where, transpose)
    _restore_non_persistent_buffers(model)


def _read(f, ckpt_name: str, fused: FusedRows | None) -> torch.Tensor:
    if fused is None:
        return f.get_tensor(ckpt_name)
    whole = f.get_slice(ckpt_name)
    rows = whole.get_shape()[0]
    if rows < fused.stop:
        raise WeightShapeMismatch(
            f"tensor {ckpt_name!r} has {rows} rows in the checkpoint, but the config implies at "
            f"least {fused.stop} (its fused parts)"
        )
    return whole[fused.start : fused.stop]


def _unique_parameters(model: CausalLM):
    """Tied weights appear once; a tied lm_head is filled from the embedding."""
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        yield name, param


def _find_checkpoint_name(name: str, locations: dict[str, Path]) -> str:
    candidates = [name]
    for prefix in OPTIONAL_PREFIXES:
        if name.startswith(prefix):
            candidates.append(name[len(prefix) :])
    for candidate in candidates:
        if candidate in locations:
            return candidate
    raise MissingWeight(f"tensor {name!r} is missing from the checkpoint (looked for {candidates})")


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str, transpose: bool) -> None:
    expected = tuple(param.shape[::-1]) if transpose else tuple(param.shape)
    if tuple(tensor.shape) != expected:
        raise WeightShapeMismatch(
            f"tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint, "
            f"but the config implies {expected}"
        )
    with torch.no_grad():
        param.copy_(tensor.T if transpose else tensor)


def _restore_non_persistent_buffers(model: CausalLM) -> None:
    # to_empty() left RoPE's inverse frequencies uninitialised; rebuild them from the config.
    from kvpage.model.layers import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = module.fresh_inv_freq().to(module.inv_freq.device)


def load_hf_tokenizer(directory: str | Path) -> HFTokenizer | None:
    """The directory's tokenizer without its weights (None without tokenizer.json)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UnknownModel(f"{directory} is not a directory (nor a builtin:NAME model)")
    return _load_tokenizer(directory, read_config(directory))


def _load_tokenizer(directory: Path, cfg: ModelConfig) -> HFTokenizer | None:
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return HFTokenizer(path, cfg.bos_token_id, eos)


def _revision(directory: Path, config_bytes: bytes) -> str:
    """Cheap content identity: the config plus each weight file's name and size (hashing GBs of
    weights at load would be slow; a changed file almost always changes size or config)."""
    h = hashlib.sha256(config_bytes)
    for file in sorted(directory.glob("*.safetensors")):
        h.update(f"{file.name}:{file.stat().st_size}".encode())
    return h.hexdigest()[:16]
