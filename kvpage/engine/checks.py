"""What the engine refuses before anything changes: a request whose id, parameters, prompt or
timeout the model, its context or the KV pool cannot serve, and a between-steps call on a sample
that is not in the state it needs (InvalidRequest); a model handed in that is not what the config
says (InvalidConfig). A refused call leaves the engine as it was."""

from __future__ import annotations

from collections.abc import Container

from kvpage.cache.manager import KVCacheManager
from kvpage.engine.requests import Requests
from kvpage.engine.sequence import SeqStatus, Sequence
from kvpage.errors import InvalidConfig, InvalidRequest
from kvpage.model.base import CausalLM
from kvpage.model.quantize import head_quantized, weight_quantization
from kvpage.sampling_params import SamplingParams


class RequestChecks:
    def __init__(
        self, vocab_size: int, max_model_len: int, max_num_seqs: int, cache: KVCacheManager
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.cache = cache

    def params(
        self, request_id: str, params: SamplingParams | None, live: Container[str]
    ) -> SamplingParams:
        """The request's sampling params (the defaults for None), checked with its id before its
        prompt is read: a new id, and no more samples than one step runs."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"sampling_params must be SamplingParams, got {type(params)}")
        if request_id in live:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        if params.n > self.max_num_seqs:
            raise InvalidRequest(
                f"n={params.n} samples run at once, more than max_num_seqs="
                f"{self.max_num_seqs} sequences per step"
            )
        return params

    def prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Every id the request names is in the vocabulary, and the prompt with its max_tokens
        fits the context and the pool."""
        vocab = self.vocab_size
        if not prompt_ids:
            raise InvalidRequest("prompt is empty: at least one token is needed")
        _in_vocabulary("stop_token_ids", params.stop_token_ids, vocab)
        if params.top_k > vocab:
            raise InvalidRequest(
                f"top_k {params.top_k} is more than the vocabulary's {vocab} tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise InvalidRequest(f"{name} {k} is more than the vocabulary's {vocab} tokens")
        _in_vocabulary("prompt token ids", prompt_ids, vocab)
        self.context(len(prompt_ids), params.max_tokens)
        need = self.cache.blocks_for(len(prompt_ids) + params.max_tokens)
        if need > self.cache.pool.num_blocks:
            raise InvalidRequest(
                f"prompt + max_tokens needs {need} KV blocks; the pool has only "
                f"{self.cache.pool.num_blocks}"
            )

    def context(self, prompt_len: int, max_tokens: int) -> None:
        """Every position the model runs must fit the context: the prompt's and each drawn
        token's but the last. A prompt may fill the context only to be scored (max_tokens 0):
        with one token more, the context could not hold it, as vLLM counts it too."""
        limit = self.max_model_len
        if prompt_len > limit:
            raise InvalidRequest(f"prompt has {prompt_len} tokens; the model's context is {limit}")
        if prompt_len + max_tokens > limit:
            full = " (a prompt that fills it can only be scored: max_tokens 0)"
            raise InvalidRequest(
                f"max_tokens {max_tokens} + prompt {prompt_len} tokens exceeds the model's "
                f"context of {limit}" + (full if prompt_len == limit else "")
            )


def _in_vocabulary(what: str, token_ids, vocab: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab})")


def timeout_seconds(timeout_s) -> None:
    """None, or a real number of seconds > 0 (not a bool, not NaN)."""
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0
    if timeout_s is not None and not ok:
        raise InvalidRequest(
            f"timeout_s must be None or a number of seconds > 0, got {timeout_s!r}"
        )


def live_sample(requests: Requests, sample_id: str) -> Sequence:
    seq = requests.sample(sample_id)
    if seq is None or seq.finished:
        raise InvalidRequest(f"no live request or sample {sample_id!r}")
    return seq


def preemptible(
    requests: Requests, sample_id: str, mode: str | None, default: str
) -> tuple[Sequence, str]:
    """The running sample a between-steps preemption takes, and the mode it uses (`default`
    for None)."""
    seq = live_sample(requests, sample_id)
    mode = default if mode is None else mode
    if mode not in ("recompute", "swap"):
        raise InvalidRequest(f"mode must be 'recompute' or 'swap', got {mode!r}")
    if seq.status is not SeqStatus.RUNNING:
        raise InvalidRequest(f"{sample_id!r} is {seq.status.value}, not running")
    return seq, mode


def suspendable(requests: Requests, sample_id: str) -> Sequence:
    seq = live_sample(requests, sample_id)
    if seq.status not in (SeqStatus.WAITING, SeqStatus.SWAPPED):
        raise InvalidRequest(
            f"{sample_id!r} is {seq.status.value}: only a waiting or "
            "swapped sample can be suspended"
        )
    return seq


def check_quantization(model: CausalLM, quantization: str, lm_head: bool) -> None:
    """A model handed in must already be what the config says (the engine never quantizes a
    caller's model behind its back: the verifier's reference shares it)."""
    found = weight_quantization(model)
    if found != quantization:
        raise InvalidConfig(
            f"quantization is {quantization!r} but the model given has {found!r} weights "
            f"(load it with load_model(..., quantization={quantization!r}))"
        )
    if head_quantized(model) != lm_head:
        raise InvalidConfig(
            f"quantize_lm_head is {lm_head} but the model given has "
            f"{'an int8' if not lm_head else 'a float'} LM head "
            f"(load it with load_model(..., quantize_lm_head={lm_head}))"
        )
