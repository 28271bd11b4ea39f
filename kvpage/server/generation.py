"""One request's life on the server: submit it, turn engine outputs into text deltas per choice
(stop strings, incremental decode), time its tokens, and hand each sample to the shadow comparison
when it is done. A request with n > 1 has n choices, one per engine sample."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from kvpage.engine.outputs import CompletionOutput, RequestOutput
from kvpage.lora.request import LoRARequest
from kvpage.model.tokenizer import Tokenizer
from kvpage.sampling_params import SamplingParams
from kvpage.server.shadow import ShadowJob
from kvpage.server.state import ServerState
from kvpage.server.text_stream import TextStream, prompt_context


@dataclass(slots=True)
class TokenLogprobs:
    """Per token of a choice (or of a delta), when logprobs were asked for."""

    top: list[dict[int, float]] = field(default_factory=list)  # the k most likely raw tokens
    chosen: list[float] = field(default_factory=list)  # the chosen token's, even outside top k
    offsets: list[int] = field(default_factory=list)  # where its text starts in the choice text

    def extend(self, other: TokenLogprobs) -> None:
        self.top.extend(other.top)
        self.chosen.extend(other.chosen)
        self.offsets.extend(other.offsets)


@dataclass(slots=True)
class Delta:
    """What one engine output adds to one choice of the response."""

    index: int  # the choice (sample) it belongs to
    text: str
    token_ids: list[int]
    logprobs: TokenLogprobs | None  # one entry per token in token_ids
    finish_reason: str | None
    cut: bool = False  # the server ended this choice (stop string) before the engine did


@dataclass(slots=True)
class Choice:
    """One sample's text as the client sees it."""

    index: int
    text: TextStream
    finish_reason: str | None = None
    logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)

    @property
    def token_ids(self) -> list[int]:
        return self.text.token_ids

    def advance(self, completion: CompletionOutput, new: list[int], final: bool) -> Delta:
        logprobs = None
        if completion.logprobs is None:
            piece = self.text.add(new, final=final)
        else:
            piece, logprobs = self._add_logged(completion, new, final)
            self.logprobs.extend(logprobs)
        cut = self.text.stopped
        if logprobs is not None and (cut or final):  # the whole response's offsets
            self.logprobs.offsets[:] = self.text.settled_offsets(self.logprobs.offsets)
        if cut:
            self.finish_reason = "stop"
            self._clamp_offsets()
        elif final:
            self.finish_reason = completion.finish_reason
        return Delta(self.index, piece, new, logprobs, self.finish_reason, cut)

    def _clamp_offsets(self) -> None:
        """Tokens of the stop string that arrived before it was complete (their text was held
        back) start where the text ends too. A stream has sent their offsets already; the
        whole response (not streamed) says where they are in the text it returns."""
        end = len(self.text.text)
        self.logprobs.offsets[:] = [min(o, end) for o in self.logprobs.offsets]

    def _add_logged(
        self, completion: CompletionOutput, new: list[int], final: bool
    ) -> tuple[str, TokenLogprobs]:
        """Adds the tokens one at a time, so each one's text offset is where its text starts in
        the choice's text, across every earlier delta (OpenAI's `text_offset`)."""
        offsets, pieces = [], []
        for i, token in enumerate(new):
            offsets.append(self.text.offset_of(token))
            pieces.append(self.text.add([token], final=final and i == len(new) - 1))
        if not new:
            pieces.append(self.text.add([], final=final))
        if self.text.stopped:  # a token past the stop string starts where the text ends
            offsets = [min(o, len(self.text.text)) for o in offsets]
        start = len(completion.logprobs) - len(new)
        chosen = completion.token_logprobs[start:]  # set whenever `logprobs` is
        return "".join(pieces), TokenLogprobs(completion.logprobs[start:], chosen, offsets)


@dataclass(slots=True)
class Generation:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None
    choices: list[Choice]
    cached_tokens: int = 0
    # max_tokens 0 with echo: the engine scores the prompt and draws nothing; every choice ends
    # with "length" and no completion tokens.
    echo_only: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None  # from the first output
    lora: LoRARequest | None = None  # the adapter the request's `model` named

    @classmethod
    def new(
        cls,
        request_id,
        prompt_ids,
        params,
        salt,
        tokenizer: Tokenizer,
        stop: list[str],
        make_stream: Callable[..., TextStream] = TextStream,
    ):
        """`make_stream`: the server's text-stream seam (ServerState.text_stream), called as
        `make_stream(tokenizer, stop, context=prompt tail)`: each choice's text follows its
        prompt."""
        context = prompt_context(prompt_ids, tokenizer)
        choices = [
            Choice(i, make_stream(tokenizer, list(stop), context=context)) for i in range(params.n)
        ]
        return cls(request_id, prompt_ids, params, salt, choices)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def num_tokens(self) -> int:
        """Completion tokens over all choices (usage)."""
        return sum(len(c.token_ids) for c in self.choices)

    def advance(self, out: RequestOutput) -> list[Delta]:
        """The deltas of one engine output. Outputs of a choice already ended are dropped."""
        self.cached_tokens = out.metrics.num_cached_tokens
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished and self.params.n > 1:
            return self._close(out)  # the request's final output: every sample at once
        completion = out.outputs[0]
        choice = self.choices[completion.index]
        if choice.finish_reason is not None:
            return []
        final = out.finished or completion.finish_reason is not None or self.echo_only
        new = [] if self.echo_only else list(out.new_token_ids)
        return self._echo_only([choice.advance(completion, new, final)])

    def _echo_only(self, deltas: list[Delta]) -> list[Delta]:
        """With max_tokens 0 the prompt reached its length before any completion token."""
        if self.echo_only:
            for delta in deltas:
                delta.finish_reason = self.choices[delta.index].finish_reason = "length"
        return deltas

    def _close(self, out: RequestOutput) -> list[Delta]:
        """Progress outputs already ended the choices whose samples finished on their own; the
        rest (never forked, or the stream had no per-token outputs) end here."""
        deltas = []
        for choice, completion in zip(self.choices, out.outputs, strict=True):
            if choice.finish_reason is None:
                new = [] if self.echo_only else completion.token_ids[len(choice.token_ids) :]
                deltas.append(choice.advance(completion, new, final=True))
        return self._echo_only(deltas)

    def shadow_jobs(self) -> list[ShadowJob]:
        """One job per sample, each with the parameters it replays with alone (none when the
        tokens drawn were dropped: nothing served to compare)."""
        if self.echo_only:
            return []
        if self.params.n == 1:
            return [self._job(self.request_id, self.params, self.choices[0])]
        return [
            self._job(f"{self.request_id}#{c.index}", self.params.for_sample(c.index), c)
            for c in self.choices
        ]

    def _job(self, job_id: str, params: SamplingParams, choice: Choice) -> ShadowJob:
        return ShadowJob(
            job_id, self.prompt_ids, params, list(choice.token_ids), self.cached_tokens
        )


async def submit(state: ServerState, gen: Generation) -> asyncio.Queue:
    """Queue the request in the engine; raises InvalidRequest before anything is sent."""
    return await state.loop.add(gen.request_id, gen.prompt_ids, gen.params, gen.salt, gen.lora)


async def run(state: ServerState, gen: Generation, sink: asyncio.Queue) -> AsyncIterator[Delta]:
    """Deltas until every choice is finished. Leaving early (client gone, stop string) aborts the
    request in the engine, which gives its blocks back; a stop string in one of several choices
    aborts only that sample."""
    try:
        async with aclosing(_deltas(state, gen, sink)) as deltas:  # closing it aborts the request
            async for delta in deltas:
                yield delta
    finally:  # every way out: finished, a stop string, the client gone, cancelled, an error
        # Its tenant goes after the engine's last event of it: the aborts queued above (a stop
        # string, a client gone) emit theirs later, on the engine thread, and name the tenant.
        state.loop.run_later(state.audit.forget, gen.request_id)


async def _deltas(state: ServerState, gen: Generation, sink: asyncio.Queue) -> AsyncIterator[Delta]:
    start = last = time.perf_counter()
    state.metrics.prompt_tokens.inc(len(gen.prompt_ids))
    if gen.lora is not None:
        state.metrics.adapter_requests.labels(gen.lora.lora_name).inc()
    async with aclosing(state.loop.outputs(gen.request_id, sink)) as outputs:
        async for out in outputs:
            if out.new_token_ids:
                now = time.perf_counter()
                (state.metrics.itl if gen.num_tokens else state.metrics.ttft).observe(now - last)
                last = now
            before = gen.num_tokens
            for delta in gen.advance(out):
                yield delta
                if delta.cut and not gen.finished:
                    state.loop.abort(f"{gen.request_id}#{delta.index}")
            state.metrics.generation_tokens.inc(gen.num_tokens - before)
            if gen.lora is not None:
                state.metrics.adapter_tokens.labels(gen.lora.lora_name).inc(gen.num_tokens - before)
            if gen.finished:
                state.metrics.e2e.observe(time.perf_counter() - start)
                break
    if gen.lora is None:  # the shadow recomputes on the base weights only
        for job in gen.shadow_jobs():
            state.shadow.offer(job)
