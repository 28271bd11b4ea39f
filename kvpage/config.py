"""Frozen configuration dataclasses shared across modules. Validation lives in __post_init__ so a
bad value fails where it is made, with a message that names it."""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

from kvpage.errors import InvalidConfig, UnsupportedModel
from kvpage.sampling_params import SEED_MAX, SEED_MIN

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Rotate only the first fraction of each head's dims, the rest pass through (Phi-3/4).
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise UnsupportedModel(
                f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(
                f"rope type {self.rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        if self.factor <= 0:
            raise UnsupportedModel(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture facts kvpage needs, independent of the checkpoint dialect they came from."""

    model_type: str  # "llama" (also Qwen2/3, Phi-3, Mistral), "gemma3" or "gpt2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    rope: RopeConfig | None = None  # None for learned absolute positions (GPT-2)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k, before RoPE
    checkpoint_family: str = ""  # the HF model_type: how its checkpoint names (and fuses) tensors
    # Per layer, the sliding window (a query at p sees keys p - W + 1 .. p) or None (global);
    # empty: every layer global.
    layer_windows: tuple[int | None, ...] = ()
    # SmolLM3: layers that apply no rotary embedding (NoPE); their keys carry no position.
    nope_layers: tuple[int, ...] = ()
    # Gemma 3: scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5), and the
    # sliding-window layers' own RoPE (None: `rope` for every layer).
    query_pre_attn_scalar: float | None = None
    local_rope: RopeConfig | None = None
    scale_attn_by_inverse_layer_idx: bool = False  # GPT-2 option
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # any of them ends generation unless ignore_eos
    revision: str = ""  # identifies the weights; part of the cache namespace

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedModel(f"{name} must be > 0, got {getattr(self, name)}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise UnsupportedModel(
                f"{len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise UnsupportedModel(f"a sliding window must be >= 1, got {self.layer_windows}")

    def rope_on(self, layer: int) -> bool:
        return layer not in self.nope_layers

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None for a global layer."""
        return self.layer_windows[layer] if self.layer_windows else None

    def position_signature(self) -> str:
        """What the KV of a token depends on besides the tokens: part of the cache namespace, so that
        a block computed under other positions is never reused."""
        if self.rope is None:
            return f"learned-abs:{self.max_position_embeddings}"
        r = self.rope
        # Written only when partial, so a full-rotary model keeps the namespace it always had.
        partial = "" if r.partial_rotary_factor == 1.0 else f":partial={r.partial_rotary_factor}"
        local = "" if self.local_rope is None else f":local-theta={self.local_rope.theta}"
        nope = "" if not self.nope_layers else f":nope={','.join(map(str, self.nope_layers))}"
        return (
            f"rope:{r.rope_type}:theta={r.theta}:factor={r.factor}:low={r.low_freq_factor}"
            f":high={r.high_freq_factor}:orig={r.original_max_position_embeddings}:dim={self.head_dim}"
            + partial
            + local
            + nope
        )


PREEMPTION_MODES = ("recompute", "swap")
# How the paged pool stores K/V (kvpage.kv.format): "auto" = the model dtype, as computed.
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8_e4m3")
# Weight quantization of the linear layers (kvpage.model.int8): "none" = the model dtype;
# "int8" = per-output-channel symmetric int8 codes + one scale per output channel.
QUANTIZATIONS = ("none", "int8")
# The weight dtypes the loader builds, by name (kvpage.model maps each to its torch dtype). The
# names live here, not in kvpage.model: the config is a bottom layer and must not import it.
MODEL_DTYPES = ("float32", "float16", "bfloat16")
# Syntax only: whether this machine has that CUDA device is the CLI's check (and torch's, when
# the model is placed), not the config's: a config may be built on a machine that will not run it.
DEVICE_SYNTAX = re.compile(r"cpu|cuda(:[0-9]+)?")
FAST_KEY_BITS = (1, 64)  # a block's fast key is a 64-bit hash, narrowed in tests


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything `LLM(...)` takes besides the model. Unset sizes are derived from the model.

    Every field is checked here. `None` is the only way to ask for a derived value: 0 is an
    error, never a silent default."""

    model: str = "builtin:tiny-llama"
    block_size: int = 16
    num_blocks: int | None = None  # KV pool size; None: from kv_cache_memory and the workload caps
    kv_cache_memory: int | None = None  # bytes for the KV pool (used when num_blocks is None)
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_blocks: int = 256  # CPU swap space, in blocks; 0: none (swap -> recompute)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max positions
    dtype: str = "float32"  # one of MODEL_DTYPES
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    quantization: str = "none"  # one of QUANTIZATIONS: the linear layers' weights
    # The LM head quantized too (the same int8 format; needs quantization "int8"). A tied model
    # keeps its embedding in the model dtype and holds an int8 copy for the head.
    quantize_lm_head: bool = False
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    seed: int = 0
    debug_checks: bool = False
    request_timeout_s: float | None = None  # None: requests never time out
    fast_key_bits: int = 64
    # Ranks (processes) one model is split across; 1 = this process alone, nothing started.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 20.0  # a collective slower than this = a hung worker
    # LoRA adapters (vLLM's names): at most max_loras resident at once, ranks up to max_lora_rank.
    # On int8 weights too: the delta is x A^T B^T on the activations, beside the int8 product
    # (kvpage.lora.apply), never merged into the codes.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # A model with global and sliding-window layers keeps each kind's KV in its own layer groups
    # (kvpage.cache.groups), and a window group gives back the blocks its window left behind;
    # False: one table for every layer (the window is still masked).
    kv_layer_groups: bool = True
    # Fast paths (kvpage.model.kernels.FAST_PATHS, checked there) the engine binds its model
    # without: the verifier's re-runs; KVPAGE_NATIVE=0 and the like add to them.
    fast_paths_off: tuple[str, ...] = ()
    # Speculative decoding, vLLM's dict (kvpage.speculative.config.SpeculativeConfig checks its
    # keys and values when the engine is built); None: plain decoding.
    speculative_config: dict | None = None

    def __post_init__(self) -> None:
        _check_text("model", self.model)
        self._check_speculative_config()
        paths = self.fast_paths_off
        if not isinstance(paths, (tuple, list)) or not all(isinstance(p, str) for p in paths):
            raise InvalidConfig(f"fast_paths_off must be a tuple of names, got {paths!r}")
        object.__setattr__(self, "fast_paths_off", tuple(paths))  # a list read back from JSON
        _check_bool("enable_lora", self.enable_lora)
        _check_bool("kv_layer_groups", self.kv_layer_groups)
        _check_int("max_loras", self.max_loras, 1)
        _check_int("max_lora_rank", self.max_lora_rank, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("num_blocks", self.num_blocks, 1, optional=True)
        _check_int("kv_cache_memory", self.kv_cache_memory, 1, optional=True)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _check_int("swap_space_blocks", self.swap_space_blocks, 0)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 1, optional=True)
        _check_choice("dtype", self.dtype, MODEL_DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_bool("quantize_lm_head", self.quantize_lm_head)
        if self.quantize_lm_head and self.quantization != "int8":
            raise InvalidConfig(
                f"quantize_lm_head must be False unless quantization is 'int8', got "
                f"{self.quantize_lm_head!r} with quantization {self.quantization!r}"
            )
        _check_device(self.device)
        _check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        _check_bool("debug_checks", self.debug_checks)
        _check_seconds("request_timeout_s", self.request_timeout_s, optional=True)
        _check_int("fast_key_bits", self.fast_key_bits, *FAST_KEY_BITS)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_seconds("tensor_parallel_timeout_s", self.tensor_parallel_timeout_s)
        if self.tensor_parallel_size > 1 and self.device != "cpu":
            raise InvalidConfig(
                "tensor parallelism runs on CPU (gloo) only for now: tensor_parallel_size "
                f"{self.tensor_parallel_size} needs device 'cpu', got {self.device!r}"
            )

    def _check_speculative_config(self) -> None:
        """A dict (or a SpeculativeConfig, kept as its dict so the config stays plain data)."""
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, dict) and hasattr(spec, "to_dict"):
            spec = spec.to_dict()
        if spec is not None and not isinstance(spec, dict):
            raise InvalidConfig(f"speculative_config must be None or a dict, got {spec!r}")
        object.__setattr__(self, "speculative_config", spec)


# --- field checks: each names the field and the value it got -----------------------------------
def _check_int(
    name: str, value: object, low: int, high: int | None = None, *, optional: bool = False
) -> None:
    """An int (a bool or a float is a mistake, not a number) in [low, high]."""
    if value is None and optional:
        return
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    what = f"None or an int {bounds}" if optional else f"an int {bounds}"
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise InvalidConfig(f"{name} must be {what}, got {value!r}")


def _check_seconds(name: str, value: object, *, optional: bool = False) -> None:
    """A duration > 0 (`not value > 0` also refuses NaN)."""
    if value is None and optional:
        return
    if not _is_real(value) or not value > 0:
        what = "None or a number > 0" if optional else "a number > 0"
        raise InvalidConfig(f"{name} must be {what} (seconds), got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidConfig(f"{name} must be True or False, got {value!r}")


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidConfig(f"{name} must be a non-empty string, got {value!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise InvalidConfig(f"{name} must be one of {choices}, got {value!r}")


def _check_device(value: object) -> None:
    if not isinstance(value, str) or not DEVICE_SYNTAX.fullmatch(value):
        raise InvalidConfig(f"device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
