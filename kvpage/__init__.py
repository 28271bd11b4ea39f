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
    ModelLoadError,
    OutOfBlocks,
    SwapError,
    TokenizerNotFound,
    UnknownModel,
)
from kvpage.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "InvalidConfig",
    "InvalidRequest",
    "InvariantViolation",
    "KVPageError",
    "LLMEngine",
    "ModelLoadError",
    "OutOfBlocks",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SwapError",
    "TokenizerNotFound",
    "UnknownModel",
]
