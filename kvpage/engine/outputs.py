"""What the engine hands back, with vLLM's names, and how a sequence's state becomes it.

One convention for every output: a finished RequestOutput is complete (each CompletionOutput from
token 0, `offset` 0); a progress output (streaming, `finished=False`) carries one sample's tokens
of this step only, from output position `offset` (copying the whole list per token would make a
request's streaming cost quadratic in its length)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpage.engine.sequence import Sequence


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
    # Speculative decoding (kvpage.engine.speculation): drafts proposed, and of them accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)  # produced by the step that made this
    error: str | None = None  # why, when a sample ended with finish_reason "error"
    # vLLM's shape: None for the first prompt token, then per token {id: logprob} (the top k and
    # the token itself); on the finished output of a request that asked for them
    prompt_logprobs: list[dict[int, float] | None] | None = None


Decode = Callable[[list[int]], str] | None  # the tokenizer's decode, if the model has one


def progress_output(seq: Sequence, new_tokens: list[int]) -> RequestOutput:
    """One sample's progress: the step's tokens and their logprobs, no text."""
    offset = len(seq.output_ids) - len(new_tokens)
    sample = CompletionOutput(
        seq.sample_index,
        list(new_tokens),
        "",
        None if seq.logprobs is None else seq.logprobs[offset:],
        seq.finish_reason,
        None if seq.token_logprobs is None else seq.token_logprobs[offset:],
        offset=offset,
    )
    return RequestOutput(
        seq.request_id,
        seq.prompt_ids,
        [sample],
        False,
        metrics(seq, seq.num_preemptions),
        new_token_ids=new_tokens,
        error=seq.error,
        # On a sample's first output, so a stream can send the prompt's rows before its tokens
        prompt_logprobs=None
        if offset or seq.prompt_logprobs is None
        else list(seq.prompt_logprobs),
    )


def final_output(samples: list[Sequence], new_tokens: list[int], decode: Decode) -> RequestOutput:
    """The finished request: all n samples by index. Samples never forked (the request ended
    before its first token) are empty, with sample 0's finish reason."""
    head = samples[0]
    outputs = [completion(s, decode) for s in samples]
    empty_logprobs = None if head.logprobs is None else []
    outputs += [
        CompletionOutput(i, [], "", empty_logprobs, head.finish_reason, empty_logprobs)
        for i in range(len(samples), head.params.n)
    ]
    preemptions = sum(s.num_preemptions for s in samples)
    error = next((s.error for s in samples if s.error), None)
    return RequestOutput(
        head.request_id,
        head.prompt_ids,
        outputs,
        True,
        metrics(head, preemptions, samples),
        new_token_ids=new_tokens,
        error=error,
        prompt_logprobs=None if head.prompt_logprobs is None else list(head.prompt_logprobs),
    )


def completion(seq: Sequence, decode: Decode) -> CompletionOutput:
    text = decode(seq.output_ids) if seq.finished and decode is not None else ""
    return CompletionOutput(
        seq.sample_index,
        list(seq.output_ids),
        text,
        None if seq.logprobs is None else list(seq.logprobs),
        seq.finish_reason,
        None if seq.token_logprobs is None else list(seq.token_logprobs),
    )


def metrics(
    seq: Sequence, num_preemptions: int, samples: list[Sequence] | None = None
) -> RequestMetrics:
    """`samples`: every sample of the request, whose draft counts add up (default: `seq`)."""
    ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
    samples = [seq] if samples is None else samples
    return RequestMetrics(
        seq.arrival_time,
        seq.first_token_time,
        ttft,
        seq.num_cached_tokens,
        num_preemptions,
        sum(s.num_draft_tokens for s in samples),
        sum(s.num_accepted_tokens for s in samples),
    )
