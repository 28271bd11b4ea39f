"""The contiguous reference generator (R14): one request alone, its KV grown step by step in plain
per-layer tensors. It imports no paging, prefix-cache or scheduling code — it is what those are
verified against."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.errors import InvalidRequest
from kvpage.model.attention import ContiguousKVCache
from kvpage.model.base import CausalLM
from kvpage.sampling import DEFAULT_SEED, make_generator, sample_token, top_logprobs
from kvpage.sampling_params import SamplingParams
from kvpage.verify.trace import CacheView, StepRecord, ViewEntry, make_record, sampler_state


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    step_logits: list[torch.Tensor]  # one (V,) float32 tensor per generated token
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str = "length"  # "length" | "stop"
    positions: list[list[int]] = field(default_factory=list)  # positions fed at each step
    records: list[StepRecord] = field(default_factory=list)  # filled when traced


@torch.inference_mode()
def generate(
    model: CausalLM,
    prompt_ids: list[int],
    params: SamplingParams,
    fallback_seed: int = DEFAULT_SEED,
    trace_as: str | None = None,
    namespace: str = "",
) -> ReferenceOutput:
    """Generate for one request alone. With `trace_as` set, `records` holds one StepRecord per
    token (request id `trace_as`, contiguous cache view, `namespace` as the expected one)."""
    check_prompt(model, prompt_ids, params)
    cache = ContiguousKVCache(model.config.num_layers)
    generator = make_generator(params, fallback_seed, model.device)
    stop_ids = stop_token_ids(model, params)
    out = ReferenceOutput([], [], [] if params.logprobs is not None else None)
    step_input = list(prompt_ids)
    while True:
        logits = _step(model, cache, step_input, out)
        token = sample_token(logits, params, generator)
        if trace_as is not None:
            record = _record(trace_as, out, step_input, logits, token, cache, namespace)
            record.sampler = sampler_state(generator, len(out.token_ids) + 1)
            out.records.append(record)
        out.token_ids.append(token)
        out.step_logits.append(logits.float().cpu())
        if out.logprobs is not None:
            out.logprobs.append(top_logprobs(logits, params.logprobs))
        if token in stop_ids:
            out.finish_reason = "stop"
            return out
        if len(out.token_ids) >= params.max_tokens:
            return out
        step_input = [token]


def _step(model: CausalLM, cache: ContiguousKVCache, ids: list[int], out: ReferenceOutput):
    start = cache.length
    positions = list(range(start, start + len(ids)))
    out.positions.append(positions)
    ids_t = torch.tensor(ids, dtype=torch.long, device=model.device)
    pos_t = torch.tensor(positions, dtype=torch.long, device=model.device)
    hidden = model(ids_t, pos_t, cache)  # (T, C)
    return model.compute_logits(hidden[-1:])[0]  # (V,)


def _record(request_id, out, step_input, logits, token, cache, namespace) -> StepRecord:
    view = CacheView(
        entries=(ViewEntry(0, -1, 0, cache.length, False, 1, "CONTIGUOUS"),),
        epoch=len(out.token_ids),
        namespace=namespace,
        block_size=0,
        contiguous=True,
        kv_dtype=str(logits.dtype).removeprefix("torch."),
    )
    return make_record(
        request_id, len(out.token_ids), step_input, out.positions[-1], logits, token, view
    )


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
