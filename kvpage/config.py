"""Frozen configuration dataclasses shared across modules. Validation lives in __post_init__ so a
bad value fails where it is made, with a message that names it."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.errors import UnsupportedModel

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

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(
                f"rope type {self.rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        if self.factor <= 0:
            raise UnsupportedModel(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture facts kvpage needs, independent of the checkpoint dialect they came from."""

    model_type: str  # "llama" (also Qwen2, Mistral-style) or "gpt2"
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

    def position_signature(self) -> str:
        """What the KV of a token depends on besides the tokens: part of the cache namespace (R5)."""
        if self.rope is None:
            return f"learned-abs:{self.max_position_embeddings}"
        r = self.rope
        return (
            f"rope:{r.rope_type}:theta={r.theta}:factor={r.factor}:low={r.low_freq_factor}"
            f":high={r.high_freq_factor}:orig={r.original_max_position_embeddings}:dim={self.head_dim}"
        )


PREEMPTION_MODES = ("recompute", "swap")
# How the paged pool stores K/V (kvpage.kv.format): "auto" = the model dtype, as computed.
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8_e4m3")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything `LLM(...)` takes besides the model. Unset sizes are derived from the model."""

    model: str = "builtin:tiny-llama"
    block_size: int = 16
    num_blocks: int | None = None  # KV pool size; None: from kv_cache_memory and the workload caps
    kv_cache_memory: int | None = None  # bytes for the KV pool (used when num_blocks is None)
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_blocks: int = 256  # CPU swap space, in blocks
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max positions
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    device: str = "cpu"
    seed: int = 0
    debug_checks: bool = False
    request_timeout_s: float | None = None
    fast_key_bits: int = 64
    # Ranks (processes) one model is split across; 1 = this process alone, nothing started.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 20.0  # a collective slower than this = a hung worker

    def __post_init__(self) -> None:
        from kvpage.errors import InvalidConfig

        if self.block_size <= 0:
            raise InvalidConfig(f"block_size must be > 0, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidConfig(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidConfig(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise InvalidConfig("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidConfig(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.swap_space_blocks < 0:
            raise InvalidConfig(f"swap_space_blocks must be >= 0, got {self.swap_space_blocks}")
        if self.tensor_parallel_size < 1 or self.tensor_parallel_timeout_s <= 0:
            raise InvalidConfig(
                "tensor_parallel_size must be >= 1 and tensor_parallel_timeout_s > 0, got "
                f"{self.tensor_parallel_size} and {self.tensor_parallel_timeout_s}"
            )
        if self.tensor_parallel_size > 1 and self.device != "cpu":
            raise InvalidConfig("tensor parallelism runs on CPU (gloo) only for now")
