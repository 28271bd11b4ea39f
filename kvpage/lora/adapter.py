"""One LoRA adapter from a PEFT directory (adapter_config.json + adapter_model.safetensors).

Supported: LoRA on q/k/v/o and gate/up/down of every or some layers, any rank up to the
engine's maximum, `lora_alpha`, `use_rslora`, and per-module ranks and alphas (`rank_pattern`,
`alpha_pattern`) matched to module names as PEFT matches them (`PeftReader.pattern_key`), so
each (layer, module) has its own rank and scale. Anything that changes the computation beyond
W x + scale * B A x (DoRA, trained biases, saved or embedding modules, trained token rows,
replicated layers, other targets) is refused with a LoRAError naming the field: never served as
if absent.

The adapter's identity is its name and a digest of its config and every tensor, so a reload
under the same name with other weights is another adapter (another cache namespace). The digest
is a contract (the verifier recomputes it from the files it writes, kvpage.verify.lora_adapters):
SHA-256 over `json.dumps(config, sort_keys=True)`, then, where rank_pattern or alpha_pattern is
set, `json.dumps([keys of rank_pattern, keys of alpha_pattern])` in the file's order (the first
matching key wins, so two configs that differ only in that order are two adapters; sorted keys
alone would hash them alike), then, in sorted key order, each tensor's key, a NUL byte and its
values as little-endian float32 in C order.

`PeftReader` is how an engine reads a directory (`LoraSlots.reader`); its `digest`, `scale` and
`pattern_key` are declared seams (kvpage.engine.hooks)."""

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
_PREFIX, _SUFFIX = "base_model.model.", ".lora_A.weight"  # PEFT's key = prefix + module + suffix
PATTERNS = ("rank_pattern", "alpha_pattern")
# Set (truthy), each changes the computation beyond W x + scale * B A x: refused by name.
_REFUSED = {
    "use_dora": "DoRA",
    "lora_bias": "a trained bias on lora_B",
    "modules_to_save": "fully trained modules",
    "trainable_token_indices": "trained embedding rows",
    "layer_replication": "replicated layers",
    "fan_in_fan_out": "transposed weights",
}

Where = tuple[int, str]  # (layer, module)


@dataclass(slots=True, eq=False)
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest module rank (r, where no rank_pattern key changes it)
    scale: float  # lora_alpha / r, or / sqrt(r) with use_rslora: the scale of a module no
    # pattern changes
    # (layer, module) -> (A (r, in), B (out, r)), in float32 as loaded
    weights: dict[Where, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str  # hex SHA-256 of the config and every tensor
    # (layer, module) -> its own scale (its rank and alpha, after rank_pattern / alpha_pattern);
    # a module not in it has `scale`
    scales: dict[Where, float] = field(default_factory=dict, repr=False)

    @property
    def identity(self) -> str:
        """What the cache namespace's adapter field holds: name and weights, length-prefixed."""
        name = self.name.encode()
        return f"{len(name)}:{self.name}:{self.digest}"

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted({module for _, module in self.weights}))

    def scale_of(self, where: Where) -> float:
        """The scale of one (layer, module)'s B A."""
        return self.scales.get(where, self.scale)


class PeftReader:
    """Reads a PEFT directory into a LoraAdapter, refusing what it cannot serve."""

    def read(self, name: str, path: str | Path, model: ModelConfig, max_rank: int) -> LoraAdapter:
        directory = Path(path)
        cfg = _read_config(directory)
        rank, alpha = _check_config(cfg)
        tensors = _read_tensors(directory)
        weights, modules = _pair(tensors)
        ranks, alphas, sources = self._per_module(cfg, modules, rank, alpha)
        _check_ranks(ranks, sources, max_rank)
        _check_shapes(weights, model, ranks, sources)
        scales = {w: self.scale(cfg, ranks[w], alphas[w]) for w in weights}
        scale, digest = self.scale(cfg, rank, alpha), self.digest(cfg, tensors)
        largest = max(ranks.values())
        return LoraAdapter(name, str(directory), largest, scale, weights, digest, scales)

    def digest(self, cfg: dict, tensors: list[tuple[str, torch.Tensor]]) -> str:
        """Hex SHA-256 of the config and every tensor, in the module docstring's recipe
        (a declared seam). `tensors`: (key, float32 tensor), sorted by key."""
        digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
        if any(cfg.get(key) for key in PATTERNS):
            digest.update(json.dumps([list(cfg.get(key) or {}) for key in PATTERNS]).encode())
        for key, tensor in tensors:
            digest.update(key.encode() + b"\0" + tensor.contiguous().numpy().tobytes())
        return digest.hexdigest()

    def scale(self, cfg: dict, rank: int, alpha: float) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (a declared seam); per
        module, with that module's rank and alpha."""
        return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank

    def pattern_key(self, keys, module: str) -> str | None:
        r"""PEFT's rule (peft.utils.other.get_pattern_key) for which rank_pattern or
        alpha_pattern key sets a module's rank or alpha: the first key, in the config's order,
        that as a regular expression matches the end of the module's full name at a dot
        boundary (`re.match(rf"(.*\.)?({key})$", module)`); None when none does (the module
        keeps r or lora_alpha). A declared seam. `module`: the name as PEFT matched it, e.g.
        "model.layers.1.self_attn.v_proj"."""
        for key in keys:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        return None

    def _per_module(self, cfg: dict, modules: dict[Where, str], rank: int, alpha: float):
        """Each module's rank, alpha, and where its rank comes from (for messages)."""
        rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
        ranks, alphas, sources = {}, {}, {}
        for where, module in modules.items():
            rank_key = self.pattern_key(rank_pattern, module)
            alpha_key = self.pattern_key(alpha_pattern, module)
            ranks[where] = rank if rank_key is None else rank_pattern[rank_key]
            alphas[where] = alpha if alpha_key is None else float(alpha_pattern[alpha_key])
            sources[where] = (
                f"r={rank}" if rank_key is None else f"rank_pattern {rank_key!r}: {ranks[where]}"
            )
        return ranks, alphas, sources


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


def _check_config(cfg: dict) -> tuple[int, float]:
    """(r, lora_alpha), or a LoRAError naming every field it cannot serve."""
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type={cfg.get('peft_type')!r} (only 'LORA')")
    if cfg.get("bias", "none") != "none":
        problems.append(f"bias={cfg.get('bias')!r} (trained biases)")
    for key, what in _REFUSED.items():
        if cfg.get(key):
            problems.append(f"{key}={json.dumps(cfg[key])} ({what})")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(TARGETS))
        if bad:
            problems.append(f"target_modules {bad} (supported: {list(TARGETS)})")
    rank = cfg.get("r")
    if not _is_rank(rank):
        problems.append(f"r={rank!r} (a rank >= 1)")
    alpha = cfg.get("lora_alpha", rank)
    if not _is_number(alpha):
        problems.append(f"lora_alpha={alpha!r}")
    problems += _pattern_problems(cfg)
    if problems:
        raise LoRAError("adapter not supported: " + "; ".join(problems))
    return rank, float(alpha)


def _pattern_problems(cfg: dict) -> list[str]:
    """rank_pattern / alpha_pattern: a JSON object of regular expressions to ranks / alphas."""
    problems = []
    for key, valid in (("rank_pattern", _is_rank), ("alpha_pattern", _is_number)):
        patterns = cfg.get(key) or {}
        if not isinstance(patterns, dict):
            problems.append(f"{key}={patterns!r} (an object of module patterns)")
            continue
        for pattern, value in patterns.items():
            if not valid(value):
                problems.append(f"{key}[{pattern!r}]={value!r}")
            try:
                re.compile(pattern)
            except re.error as err:
                problems.append(f"{key} key {pattern!r} is not a regular expression ({err})")
    return problems


def _is_rank(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    """(layer, module) -> (A, B), and (layer, module) -> the module's full name in the model,
    as PEFT matched its patterns against it (the key less PEFT's prefix and the factor's
    suffix: "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight" is
    "model.layers.1.self_attn.v_proj")."""
    halves: dict[Where, dict[str, torch.Tensor]] = {}
    modules: dict[Where, str] = {}
    for key, tensor in tensors:
        match = _WEIGHT.match(key)
        where = (int(match[1]), match[2])
        halves.setdefault(where, {})[match[3]] = tensor
        if match[3] == "A":
            modules[where] = key.removeprefix(_PREFIX).removesuffix(_SUFFIX)
    weights = {}
    for where, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"layer {where[0]} {where[1]}: lora_A and lora_B must both be present")
        weights[where] = (pair["A"], pair["B"])
    return weights, modules


def _check_ranks(ranks: dict[Where, int], sources: dict[Where, str], max_rank: int) -> None:
    """max_lora_rank bounds every module's rank (a slot holds that many columns)."""
    where = max(ranks, key=lambda w: ranks[w])
    if ranks[where] > max_rank:
        raise LoRAError(
            f"layer {where[0]} {where[1]}: {sources[where]} is above max_lora_rank={max_rank}"
        )


def _check_shapes(weights, model: ModelConfig, ranks, sources) -> None:
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
        rank = ranks[layer, module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAError(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                f"the model and {sources[layer, module]} imply {(rank, fan_in)} / "
                f"{(fan_out, rank)}"
            )
