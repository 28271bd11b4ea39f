"""What the engine hands back, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str  # decoded once the request finishes ("" while it runs)
    logprobs: list[dict[int, float]] | None  # per token: the k most likely raw tokens
    finish_reason: str | None  # "stop" | "length" | "abort" | "timeout" | "error" | None
    # Per token: the chosen token's raw logprob, also when it is outside the top k (as OpenAI
    # reports it). Kept apart from `logprobs`, which must be exactly the top k.
    token_logprobs: list[float] | None = None
    # Output position of token_ids[0]. A finished RequestOutput is complete (offset 0); every
    # other one is a progress output holding only the step's new tokens (and their logprobs).
    offset: int = 0


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    ttft: float | None  # seconds from arrival to the first output token
    num_cached_tokens: int  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)  # produced by the step that made this
    error: str | None = None  # why, when a sample ended with finish_reason "error"
