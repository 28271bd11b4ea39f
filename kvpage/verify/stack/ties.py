"""Numeric ties in the whole-stack suite (16-bit models, as the gate's diff.is_numeric_tie).

The server's engine and the contiguous reference compute the same logits up to rounding; in
bfloat16 two tokens the reference scores within the logit tolerance of each other can swap, and
from there the server's text follows another, equally right path. The suite then expects the
reference's text along the engine's tokens, forced only at such ties: `StepRecorder` (an engine
observer) keeps each sample's draws (token, logits, generator state); `follow_ties` runs the
reference step by step and, where its token differs from the engine's, takes the engine's when
the step is a tie:

  - the engine's logits at that step are within `atol` of the reference's (the same inputs: the
    path so far is the same), and
  - greedy: the reference scores the engine's token within `atol` of its own choice;
    sampled: the draw came from the same generator state (the same uniform fell on a boundary
    the drift moved) and is possible under the sampling oracle on the engine's logits.

Anything else is not forced: the reference keeps its own token and the response is compared with
it, so a wrong token still fails. The text layer (stop strings, offsets, logprobs, usage) is
always checked against the text oracle over the path the reference decided."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.engine.events import EngineObserver
from kvpage.reference.generator import ReferenceOutput, stop_token_ids
from kvpage.reference.kv_oracle import RoundTrip, RoundTripKVCache
from kvpage.reference.records import sampler_state
from kvpage.reference.weight_oracle import reference_model
from kvpage.sampling import DEFAULT_SEED, make_generator, sample_token
from kvpage.sampling_params import SamplingParams
from kvpage.verify.sampling_oracle import check_draw


@dataclass(frozen=True, slots=True)
class EngineDraw:
    token: int
    logits: torch.Tensor  # (V,) float32, the engine's row the token was drawn from
    sampler: dict | None  # sampler_state after the draw (None: greedy)


@dataclass(slots=True)
class StepRecorder(EngineObserver):
    """Every sample's draws, in order. Requests run one at a time, so `take` (after a
    response) returns the one request that came since the last take, by sample id."""

    draws: dict[str, list[EngineDraw]] = field(default_factory=dict)
    taken: set[str] = field(default_factory=set)  # request ids already handed out

    def on_sampled(self, batch, logits: torch.Tensor, tokens: list[int]) -> None:
        for row, (item, token) in enumerate(zip(batch.sample_seqs, tokens, strict=True)):
            self._add(item.seq, logits[row], token)

    def on_forked(self, parent, child, logits_row: torch.Tensor, token: int) -> None:
        self._add(child, logits_row, token)

    def _add(self, seq, logits: torch.Tensor, token: int) -> None:
        if seq.request_id in self.taken:
            return  # a request aborted after its response (a stop string) still stepping
        draw = EngineDraw(
            int(token),
            logits.detach().float().cpu().clone(),
            sampler_state(seq.generator, seq.num_draws),
        )
        self.draws.setdefault(seq.sample_id, []).append(draw)

    def take(self) -> dict[int, list[EngineDraw]] | None:
        """Sample index -> its draws, for the one request since the last take (None when not
        exactly one request ran: nothing to follow)."""
        draws, self.draws = self.draws, {}
        requests = {sid.split("#")[0] for sid in draws}
        self.taken |= requests
        if len(requests) != 1:
            return None
        return {int(sid.split("#")[1]) if "#" in sid else 0: steps for sid, steps in draws.items()}


def follow_ties(
    model,
    prompt: list[int],
    params: SamplingParams,
    engine: list[EngineDraw],
    atol: float,
) -> ReferenceOutput | None:
    """The reference along `engine`'s tokens where they differ from its own by a numeric tie
    (the module's docstring); None when no step was a tie (the reference's own run stands)."""
    with torch.inference_mode():
        return _follow(reference_model(model), prompt, params, engine, atol)


def _follow(model, prompt, params, engine, atol) -> ReferenceOutput | None:
    cache = RoundTripKVCache(model.config.num_layers, RoundTrip("auto"))
    generator = make_generator(params, DEFAULT_SEED, model.device)
    stop_ids = stop_token_ids(model, params)
    out = ReferenceOutput([], [], [] if params.logprobs is not None else None)
    ties, forcing, step_input = 0, True, list(prompt)
    while True:
        logits = _step(model, cache, step_input)
        token = sample_token(logits, params, generator)
        step = len(out.token_ids)
        if forcing and step < len(engine) and engine[step].token != token:
            state = sampler_state(generator, step + 1)
            if is_tie(logits.float().cpu(), token, engine[step], state, params, atol):
                token, ties = engine[step].token, ties + 1
            else:
                forcing = False  # a real difference: the reference's own path from here
        if out.append(token, logits, params, stop_ids):
            break
        step_input = [token]
    return out if ties else None


def _step(model, cache: RoundTripKVCache, ids: list[int]) -> torch.Tensor:
    start = cache.length
    positions = torch.arange(start, start + len(ids), dtype=torch.long, device=model.device)
    ids_t = torch.tensor(ids, dtype=torch.long, device=model.device)
    hidden = model(ids_t, positions, cache)  # (T, C)
    return model.compute_logits(hidden[-1:])[0]  # (V,)


def is_tie(
    ref_logits: torch.Tensor,
    ref_token: int,
    draw: EngineDraw,
    ref_sampler: dict | None,
    params: SamplingParams,
    atol: float,
) -> bool:
    """Whether the engine's other token at a step with the reference's inputs is a numeric tie
    (the module's docstring)."""
    if float((draw.logits - ref_logits).abs().max()) > atol:
        return False
    if params.temperature == 0.0:
        return float(ref_logits[ref_token] - ref_logits[draw.token]) <= atol
    if ref_sampler is None or draw.sampler != ref_sampler:
        return False
    return check_draw(draw.logits, params, draw.token) is None
