"""One LoRA adapter from a PEFT directory (adapter_config.json + adapter_model.safetensors).

Supported: LoRA on q/k/v/o and gate/up/down of every or some layers, any rank up to the
engine's maximum, `lora_alpha`, `use_rslora`. Anything that changes the computation beyond
W x + scale * B A x (DoRA, trained biases, saved or embedding modules, per-module ranks, other
targets) is refused with a LoRAError naming the field: never served as if absent.

The adapter's identity is its name and a digest of its config and every tensor, so a reload
under the same name with other weights is another adapter (another cache namespace). The digest
is a contract (the verifier recomputes it from the files it writes, kvpage.verify.lora_adapters):
SHA-256 over `json.dumps(config, sort_keys=True)`, then, in sorted key order, each tensor's key,
a NUL byte and its values as little-endian float32 in C order.

`PeftReader` is how an engine reads a directory (`LoraSlots.reader`); its `digest` and `scale`
are declared seams (kvpage.engine.hooks)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from kvpage.config import ModelConfig
from kvpage.errors import LoRAError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHT = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(slots=True, eq=False)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / rank, or / sqrt(rank) with use_rslora
    # (layer, module) -> (A (r, in), B (out, r)), in float32 as loaded
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str  # hex SHA-256 of the config and every tensor

    @property
    def identity(self) -> str:
        """What the cache namespace's adapter field holds: name and weights, length-prefixed."""
        name = self.name.encode()
        return f"{len(name)}:{self.name}:{self.digest}"

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted({module for _, module in self.weights}))


class PeftReader:
    """Reads a PEFT directory into a LoraAdapter, refusing what it cannot serve."""

    def read(self, name: str, path: str | Path, model: ModelConfig, max_rank: int) -> LoraAdapter:
        directory = Path(path)
        cfg = _read_config(directory)
        rank, alpha = _check_config(cfg, max_rank)
        tensors = _read_tensors(directory)
        weights = _pair(tensors)
        _check_shapes(weights, model, rank)
        scale, digest = self.scale(cfg, rank, alpha), self.digest(cfg, tensors)
        return LoraAdapter(name, str(directory), rank, scale, weights, digest)

    def digest(self, cfg: dict, tensors: list[tuple[str, torch.Tensor]]) -> str:
        """Hex SHA-256 of the config and every tensor, in the module docstring's recipe
        (a declared seam). `tensors`: (key, float32 tensor), sorted by key."""
        digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
        for key, tensor in tensors:
            digest.update(key.encode() + b"\0" + tensor.contiguous().numpy().tobytes())
        return digest.hexdigest()

    def scale(self, cfg: dict, rank: int, alpha: float) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (a declared seam)."""
        return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def load_peft_adapter(
    name: str, path: str | Path, model: ModelConfig, max_rank: int
) -> LoraAdapter:
    return PeftReader().read(name, path, model, max_rank)


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise LoRAError(f"no {CONFIG_FILE} in {directory}: not a PEFT adapter directory")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise LoRAError(f"{path}: {err}") from err


def _check_config(cfg: dict, max_rank: int) -> tuple[int, float]:
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type={cfg.get('peft_type')!r} (only 'LORA')")
    if cfg.get("use_dora"):
        problems.append("use_dora=true (DoRA)")
    if cfg.get("bias", "none") != "none":
        problems.append(f"bias={cfg.get('bias')!r} (trained biases)")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save={cfg['modules_to_save']} (fully trained modules)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            problems.append(f"{key}={cfg[key]} (per-module ranks or alphas)")
    if cfg.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out=true")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(TARGETS))
        if bad:
            problems.append(f"target_modules {bad} (supported: {list(TARGETS)})")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        problems.append(f"r={rank!r} (a rank >= 1)")
    elif rank > max_rank:
        problems.append(f"r={rank} is above max_lora_rank={max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        problems.append(f"lora_alpha={alpha!r}")
    if problems:
        raise LoRAError("adapter not supported: " + "; ".join(problems))
    return rank, float(alpha)


def _read_tensors(directory: Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the weights file as float32, sorted by key; names checked."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise LoRAError(f"no {WEIGHTS_FILE} in {directory}")
    tensors = []
    with safe_open(str(path), framework="pt") as f:
        for key in sorted(f.keys()):
            match = _WEIGHT.match(key)
            if match is None:
                raise LoRAError(
                    f"{WEIGHTS_FILE}: tensor {key!r} is not a q/k/v/o/gate/up/down LoRA A or B"
                )
            if match[2] not in TARGETS:
                raise LoRAError(
                    f"{WEIGHTS_FILE}: {key!r} targets {match[2]!r} (supported: {TARGETS})"
                )
            tensors.append((key, f.get_tensor(key).float()))
    if not tensors:
        raise LoRAError(f"{WEIGHTS_FILE} holds no LoRA weights")
    return tensors


def _pair(tensors: list[tuple[str, torch.Tensor]]):
    """(layer, module) -> (A, B)."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors:
        match = _WEIGHT.match(key)
        halves.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor
    weights = {}
    for where, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"layer {where[0]} {where[1]}: lora_A and lora_B must both be present")
        weights[where] = (pair["A"], pair["B"])
    return weights


def _check_shapes(weights, model: ModelConfig, rank: int) -> None:
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    c, f = model.hidden_size, model.intermediate_size
    shapes = {  # module -> (in, out)
        "q_proj": (c, q), "k_proj": (c, kv), "v_proj": (c, kv), "o_proj": (q, c),
        "gate_proj": (c, f), "up_proj": (c, f), "down_proj": (f, c),
    }  # fmt: skip
    for (layer, module), (a, b) in weights.items():
        if not 0 <= layer < model.num_layers:
            raise LoRAError(f"{module} of layer {layer}: the model has {model.num_layers} layers")
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAError(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                f"the model and r={rank} imply {(rank, fan_in)} / {(fan_out, rank)}"
            )
