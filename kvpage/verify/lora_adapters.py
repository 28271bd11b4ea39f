"""The verifier's LoRA adapters: described by a seed and a shape (`LoraSpec`, model-agnostic like
every case), made for the model under test on demand with random A and B large enough to change
greedy tokens, and written as PEFT directories (adapter_config.json + adapter_model.safetensors)
that the engine loads by path, as a server or `LLM(enable_lora=True)` does: the gate reads what
the server reads. Same spec, same model: the same files (same digest).

`write_peft` also hashes what it wrote, on its own: the digest recipe the engine's identity is
defined by (kvpage.lora.adapter's docstring), computed here from the config and tensors as
written, never by the loader's function. The lora suite checks the engine's loaded digest against
it, and the reference merges the files, reading the directory with its own code
(kvpage.reference.lora_merge)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from kvpage.config import ModelConfig
from kvpage.lora.adapter import TARGETS, LoraAdapter, load_peft_adapter
from kvpage.reference.lora_merge import pattern_value

ALL = TARGETS
B_STD = 0.2  # the B factors' scale: every adapter changes the greedy tokens within 2 steps, and the model stays as well conditioned as the base in 16 bits
CONFIG_FILE = "adapter_config.json"  # PEFT's names, spelled here, not taken from the loader
WEIGHTS_FILE = "adapter_model.safetensors"
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    name: str
    seed: int
    targets: tuple[str, ...] = ALL
    rank: int = 4
    alpha: float = 8.0
    rslora: bool = False  # use_rslora: scale = alpha / sqrt(rank), not alpha / rank
    # PEFT's rank_pattern / alpha_pattern, in the order written (the first matching key wins):
    # (module pattern, rank or alpha) pairs
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    @property
    def max_rank(self) -> int:
        """A bound on every module's rank (max_lora_rank for this adapter)."""
        return max((self.rank, *(rank for _, rank in self.rank_pattern)))

    def module_rank(self, module_name: str) -> int:
        """A module's rank by PEFT's rule (the reference's reading of it): rank_pattern's first
        matching key, else `rank`. `module_name`: e.g. "model.layers.1.self_attn.v_proj"."""
        return pattern_value(dict(self.rank_pattern), module_name, self.rank)

    @property
    def path(self) -> str:
        """A name for the adapter where no directory is meant (make_adapter's adapters)."""
        return f"builtin:lora/{self.name}/{self.seed}"


@dataclass(frozen=True, slots=True)
class WrittenAdapter:
    """A spec written as a PEFT directory, and the verifier's own hash of what it wrote."""

    spec: LoraSpec
    path: str
    digest: str

    @property
    def identity(self) -> str:
        """The cache namespace's adapter field: the name's UTF-8 length, the name, the digest."""
        return f"{len(self.spec.name.encode())}:{self.spec.name}:{self.digest}"


def peft_config(spec: LoraSpec) -> dict:
    """adapter_config.json as PEFT writes it (the fields kvpage reads, and `use_rslora` always,
    as PEFT does; the patterns where the spec has them, in its order)."""
    config = {
        "peft_type": "LORA",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "use_rslora": spec.rslora,
        "target_modules": list(spec.targets),
        "bias": "none",
    }
    if spec.rank_pattern or spec.alpha_pattern:
        config.update(rank_pattern=dict(spec.rank_pattern), alpha_pattern=dict(spec.alpha_pattern))
    return config


def peft_tensors(spec: LoraSpec, model: ModelConfig) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors' tensors under PEFT's names, float32, seeded by the spec."""
    g = torch.Generator().manual_seed(spec.seed)
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    c, f = model.hidden_size, model.intermediate_size
    fans = {
        "q_proj": (c, q), "k_proj": (c, kv), "v_proj": (c, kv), "o_proj": (q, c),
        "gate_proj": (c, f), "up_proj": (c, f), "down_proj": (f, c),
    }  # fmt: skip
    tensors = {}
    for layer in range(model.num_layers):
        for module in spec.targets:
            fan_in, fan_out = fans[module]
            block = "self_attn" if module in _ATTENTION else "mlp"
            name = f"model.layers.{layer}.{block}.{module}"
            prefix, rank = f"base_model.model.{name}", spec.module_rank(name)
            a = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=g) * B_STD
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    return tensors


def files_digest(config: dict, tensors: dict[str, torch.Tensor]) -> str:
    """Hex SHA-256 over the config (canonical JSON), the order of the pattern keys where there
    are patterns, and every tensor in key order: its key, a NUL and its values as
    little-endian float32, C order. Written here from the recipe, so a loader whose digest
    leaves something out (the tensor bytes, a key, the patterns' order) disagrees with it."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    orders = [list(config.get(k) or {}) for k in ("rank_pattern", "alpha_pattern")]
    if any(orders):
        digest.update(json.dumps(orders).encode())
    for key in sorted(tensors):
        values = np.ascontiguousarray(tensors[key].detach().cpu().numpy(), dtype="<f4")
        digest.update(key.encode() + b"\0" + values.tobytes())
    return digest.hexdigest()


def write_peft(spec: LoraSpec, model: ModelConfig, directory: Path) -> WrittenAdapter:
    config, tensors = peft_config(spec), peft_tensors(spec, model)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    save_file(tensors, str(directory / WEIGHTS_FILE))
    return WrittenAdapter(spec, str(directory), files_digest(config, tensors))


def save_peft(spec: LoraSpec, model: ModelConfig, directory: Path) -> Path:
    """The spec's adapter written as a PEFT directory (engines in other processes)."""
    write_peft(spec, model, directory)
    return directory


def make_adapter(spec: LoraSpec, model: ModelConfig) -> LoraAdapter:
    """The spec's adapter as the engine's loader reads it (for tests that register adapters
    themselves); its path is the spec's name for it, the directory being gone."""
    with tempfile.TemporaryDirectory(prefix="kvpage-lora-") as tmp:
        written = write_peft(spec, model, Path(tmp) / spec.name)
        adapter = load_peft_adapter(spec.name, written.path, model, spec.max_rank)
    adapter.path = spec.path
    return adapter


class AdapterFiles:
    """The specs' PEFT directories for one model, written once each into a temporary
    directory that lives as long as this object."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = model
        self.root = Path(tempfile.mkdtemp(prefix="kvpage-verify-lora-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)
        self.written: dict[LoraSpec, WrittenAdapter] = {}

    def __call__(self, spec: LoraSpec) -> WrittenAdapter:
        if spec not in self.written:
            directory = self.root / f"{len(self.written)}-{spec.name.encode().hex()}"
            self.written[spec] = write_peft(spec, self.model, directory)
        return self.written[spec]
