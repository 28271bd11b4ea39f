"""kvpage: a paged-KV-cache inference engine whose every cache reuse is verified token by token."""

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.engine.llm import LLM
from kvpage.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpage.errors import (
    InvalidConfig,
    InvalidRequest,
    InvariantViolation,
    KVPageError,
    LoRAError,
    ModelLoadError,
    OutOfBlocks,
    SwapError,
    TokenizerNotFound,
    UnknownModel,
)
from kvpage.lora.request import LoRARequest
from kvpage.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "InvalidConfig",
    "InvalidRequest",
    "InvariantViolation",
    "KVPageError",
    "LLMEngine",
    "LoRAError",
    "LoRARequest",
    "ModelLoadError",
    "OutOfBlocks",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "SwapError",
    "TokenizerNotFound",
    "UnknownModel",
]
