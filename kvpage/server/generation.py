"""One request's life on the server: submit it, turn engine outputs into text deltas (stop strings,
incremental decode), time its tokens, and hand it to the shadow comparison when it is done."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from kvpage.engine.outputs import RequestOutput
from kvpage.sampling_params import SamplingParams
from kvpage.server.shadow import ShadowJob
from kvpage.server.state import ServerState
from kvpage.server.text_stream import TextStream


@dataclass(slots=True)
class Delta:
    """What one engine output adds to the response."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # one top-k dict per token in token_ids
    finish_reason: str | None


@dataclass(slots=True)
class Generation:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None
    text: TextStream
    cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.text.token_ids

    def advance(self, out: RequestOutput) -> Delta:
        completion = out.outputs[0]
        new = list(out.new_token_ids)
        piece = self.text.add(new, final=out.finished)
        logprobs = None
        if completion.logprobs is not None:
            logprobs = completion.logprobs[len(completion.logprobs) - len(new) :] if new else []
            self.logprobs.extend(logprobs)
        self.cached_tokens = out.metrics.num_cached_tokens
        if self.text.stopped:
            self.finish_reason = "stop"
        elif out.finished:
            self.finish_reason = completion.finish_reason
        return Delta(piece, new, logprobs, self.finish_reason)


async def submit(state: ServerState, gen: Generation) -> asyncio.Queue:
    """Queue the request in the engine; raises InvalidRequest before anything is sent."""
    return await state.loop.add(gen.request_id, gen.prompt_ids, gen.params, gen.salt)


async def run(state: ServerState, gen: Generation, sink: asyncio.Queue) -> AsyncIterator[Delta]:
    """Deltas until the request finishes. Leaving early (client gone, stop string) aborts it in
    the engine, which gives its blocks back."""
    last = time.perf_counter()
    async with aclosing(state.loop.outputs(gen.request_id, sink)) as outputs:
        async for out in outputs:
            if out.new_token_ids:
                now = time.perf_counter()
                (state.metrics.itl if gen.token_ids else state.metrics.ttft).observe(now - last)
                last = now
            delta = gen.advance(out)
            yield delta
            if delta.finish_reason is not None:
                break
    state.shadow.offer(
        ShadowJob(
            gen.request_id, gen.prompt_ids, gen.params, list(gen.token_ids), gen.cached_tokens
        )
    )
