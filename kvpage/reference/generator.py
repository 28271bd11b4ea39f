"""The contiguous reference generator: one request alone, its KV grown step by step in plain
per-layer tensors. It imports no paging, prefix-cache or scheduling code — it is what those are
verified against."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.errors import InvalidRequest
from kvpage.model.base import CausalLM
from kvpage.reference.grammar import ReferenceGrammars, ReferenceMatcher, masked
from kvpage.reference.kv_oracle import RoundTrip, RoundTripKVCache
from kvpage.reference.records import (
    CacheView,
    StepRecord,
    ViewEntry,
    grammar_note,
    make_record,
    sampler_state,
    scale_digest,
)
from kvpage.reference.weight_oracle import reference_model
from kvpage.sampling import DEFAULT_SEED, make_generator, sample_token, top_logprobs
from kvpage.sampling_params import SamplingParams


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    step_logits: list[torch.Tensor]  # one (V,) float32 tensor per generated token
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str = "length"  # "length" | "stop"
    positions: list[list[int]] = field(default_factory=list)  # positions fed at each step
    records: list[StepRecord] = field(default_factory=list)  # filled when traced

    def append(
        self,
        token: int,
        logits: torch.Tensor,
        params: SamplingParams,
        stop_ids,
        grammar_done: bool = False,
    ) -> bool:
        """Take the drawn token and its step's logits (and top logprobs where asked); True when
        the request is finished (a stop token, a complete grammar, or max_tokens reached)."""
        self.token_ids.append(token)
        self.step_logits.append(logits.float().cpu())
        if self.logprobs is not None:
            self.logprobs.append(top_logprobs(logits, params.logprobs))
        if token in stop_ids or grammar_done:
            self.finish_reason = "stop"
            return True
        return len(self.token_ids) >= params.max_tokens


@torch.inference_mode()
def generate(
    model: CausalLM,
    prompt_ids: list[int],
    params: SamplingParams,
    fallback_seed: int = DEFAULT_SEED,
    trace_as: str | None = None,
    namespace: str = "",
    kv_cache_dtype: str = "auto",
    scale_span: int = 0,
    grammars: ReferenceGrammars | None = None,
    forced: tuple[int, ...] | None = None,
) -> ReferenceOutput:
    """Generate for one request alone. With `trace_as` set, `records` holds one StepRecord per
    token (request id `trace_as`, contiguous cache view, `namespace` as the expected one).
    `kv_cache_dtype`: every K/V vector goes through that format's round trip before it is
    stored and read (kvpage.reference.kv_oracle); `scale_span` > 0 (a block size) makes a traced
    view carry one digest of the scales per span of that many tokens, as a paged view has one
    per block. Every forward pass runs on a twin of the model bound to torch's operators alone
    (kvpage.reference.weight_oracle.reference_model; an int8-weight model's dequantises): no
    kernel the engine takes. A constrained request (params.structured_outputs) draws through
    `grammars`' own matcher (kvpage.reference.grammar): masked first, then sampled; its
    records carry what the grammar allowed at each step. `forced`: the tokens to take instead
    of drawing, while they last (a speculative engine's sampled output, whose draws are its
    rejection rule's: the reference scores the same path, the oracle judges the draws)."""
    return _generate(
        reference_model(model), prompt_ids, params, fallback_seed, trace_as, namespace,
        kv_cache_dtype, scale_span, _matcher(params, grammars), forced or (),
    )  # fmt: skip


def _matcher(params: SamplingParams, grammars: ReferenceGrammars | None):
    if params.structured_outputs is None:
        return None
    if grammars is None:  # never an unconstrained answer for a constrained request
        raise InvalidRequest("a constrained request needs the reference's grammars")
    return grammars.matcher(params.structured_outputs)


def _generate(
    model, prompt_ids, params, fallback_seed, trace_as, namespace, kv_cache_dtype, scale_span,
    matcher: ReferenceMatcher | None, forced: tuple[int, ...] = (),
) -> ReferenceOutput:  # fmt: skip
    check_prompt(model, prompt_ids, params)
    cache = RoundTripKVCache(model.config.num_layers, RoundTrip(kv_cache_dtype))
    generator = make_generator(params, fallback_seed, model.device)
    stop_ids = stop_token_ids(model, params)
    out = ReferenceOutput([], [], [] if params.logprobs is not None else None)
    step_input = list(prompt_ids)
    while params.max_tokens > 0:  # 0: the prompt is only scored, nothing is drawn
        logits = _step(model, cache, step_input, out)
        allowed = None if matcher is None else matcher.allowed()
        if len(out.token_ids) < len(forced):
            token = forced[len(out.token_ids)]
        else:
            token = sample_token(
                logits if allowed is None else masked(logits, allowed), params, generator
            )
        done = matcher is not None and _advance(matcher, token)
        if trace_as is not None:
            record = _record(
                trace_as, out, step_input, logits, token, cache, namespace, model, scale_span
            )
            record.sampler = sampler_state(generator, len(out.token_ids) + 1)
            record.grammar = None if allowed is None else grammar_note(allowed, done)
            record.allowed = allowed
            out.records.append(record)
        if out.append(token, logits, params, stop_ids, done):
            return out
        step_input = [token]
    return out


def _advance(matcher: ReferenceMatcher, token: int) -> bool:
    """Take the drawn token; True when the grammar is complete after it."""
    if not matcher.consume(token):  # drawn from the mask: a refusal is the reference's bug
        raise RuntimeError(
            f"the reference's grammar refused its own token {token}: {matcher.error}"
        )
    return matcher.stopped


def _step(model: CausalLM, cache: RoundTripKVCache, ids: list[int], out: ReferenceOutput):
    start = cache.length
    positions = list(range(start, start + len(ids)))
    out.positions.append(positions)
    ids_t = torch.tensor(ids, dtype=torch.long, device=model.device)
    pos_t = torch.tensor(positions, dtype=torch.long, device=model.device)
    hidden = model(ids_t, pos_t, cache)  # (T, C)
    return model.compute_logits(hidden[-1:])[0]  # (V,)


def _record(
    request_id, out, step_input, logits, token, cache, namespace, model, scale_span
) -> StepRecord:
    trip = cache.round_trip
    view = CacheView(
        entries=(ViewEntry(0, -1, 0, cache.length, False, 1, "CONTIGUOUS"),),
        epoch=len(out.token_ids),
        namespace=namespace,
        block_size=0,
        contiguous=True,
        kv_dtype=trip.kv_dtype(model.dtype),
        kv_layout=trip.layout_version,
        scale_digests=_span_digests(cache, scale_span),
        layer_windows=model.config.layer_windows,
    )
    return make_record(
        request_id, len(out.token_ids), step_input, out.positions[-1], logits, token, view
    )


def _span_digests(cache: RoundTripKVCache, span: int) -> tuple[str, ...]:
    """One digest of the scales per `span` tokens of the context (what block j of a paged
    view with block size `span` holds)."""
    if span <= 0 or not cache.round_trip.quantized:
        return ()
    scales = cache.scales_of(0, cache.length)  # (L, 2, T, KVH)
    return tuple(scale_digest(scales[:, :, i : i + span]) for i in range(0, cache.length, span))


def stop_token_ids(model: CausalLM, params: SamplingParams) -> frozenset[int]:
    eos = () if params.ignore_eos else model.config.eos_token_ids
    return frozenset((*eos, *params.stop_token_ids))


def check_prompt(model: CausalLM, prompt_ids: list[int], params: SamplingParams) -> None:
    cfg = model.config
    if not prompt_ids:
        raise InvalidRequest("prompt is empty: at least one token is needed")
    bad = [t for t in prompt_ids if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids {bad[:5]} are outside [0, {cfg.vocab_size})")
    total = len(prompt_ids) + params.max_tokens
    if total > cfg.max_position_embeddings:
        raise InvalidRequest(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the model's {cfg.max_position_embeddings} positions"
        )


@torch.inference_mode()
def prompt_logits(
    model: CausalLM, prompt_ids: list[int], kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """(L, V) logits of one forward pass over the whole prompt. With a rounded KV format every
    K/V vector goes through its round trip before attention reads it, as the paged engine's
    prefill reads the stored form of the prompt's own new tokens too."""
    ref = reference_model(model)
    if kv_cache_dtype == "auto":
        return ref.forward_full(prompt_ids)
    cache = RoundTripKVCache(ref.config.num_layers, RoundTrip(kv_cache_dtype))
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=ref.device)
    positions = torch.arange(len(prompt_ids), device=ref.device)
    return ref.compute_logits(ref(ids, positions, cache))


@torch.inference_mode()
def prompt_logprobs(
    model: CausalLM, prompt_ids: list[int], k: int, kv_cache_dtype: str = "auto"
) -> list[dict[int, float] | None]:
    """Prompt logprobs from one forward pass over the whole prompt (prompt_logits): None for
    the first token, then per token the top k of the logits before it and the token itself."""
    logits = prompt_logits(model, prompt_ids, kv_cache_dtype)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (L, V)
    rows: list[dict[int, float] | None] = [None]
    for p, token in enumerate(prompt_ids[1:]):
        row = {}
        if k:
            values, ids = torch.topk(logprobs[p], k)
            row = dict(zip(ids.tolist(), values.tolist(), strict=True))
        row[token] = float(logprobs[p, token])
        rows.append(row)
    return rows
