"""Several prompts in one completions request (OpenAI's batch): each prompt is its own engine
request, so the prompts share prefixes and batch like any others. Choice `i * n + j` is sample j
of prompt i, in the whole response and in every stream chunk."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from kvpage.errors import InvalidRequest
from kvpage.model.tokenizer import Tokenizer
from kvpage.server.engine_loop import EngineFailure
from kvpage.server.generation import Delta, Generation, run, submit
from kvpage.server.protocol import ApiError, error_body, invalid_request, usage
from kvpage.server.responses import Shape, chunk_body, echo_of, final_body, sse
from kvpage.server.state import ServerState
from kvpage.server.structured import Constraint, is_constraint_error, refusal

MAX_PROMPTS = 256  # prompts per request: each one is an engine request of its own


async def submit_all(
    state: ServerState, gens: list[Generation], tenant, constraint: Constraint | None = None
) -> list[asyncio.Queue]:
    """Queue every prompt; if one is refused, the ones queued before it are aborted (drained in
    the background) and the refusal names the prompt (or the constraint they all share)."""
    sinks: list[asyncio.Queue] = []
    for i, gen in enumerate(gens):
        state.audit.admit(gen.request_id, tenant, None if gen.lora is None else gen.lora.lora_name)
        try:
            sinks.append(await submit(state, gen))
        except InvalidRequest as err:
            state.audit.forget(gen.request_id)
            for queued, sink in zip(gens, sinks, strict=False):
                state.loop.abort(queued.request_id)
                asyncio.get_running_loop().create_task(_drain(state, queued, sink))
            if constraint is not None and is_constraint_error(err):
                raise refusal(err, constraint) from err
            api = invalid_request(err)
            raise ApiError(f"prompt {i}: {api.message}", "prompt") from err
    return sinks


async def _drain(state: ServerState, gen: Generation, sink: asyncio.Queue) -> None:
    async with aclosing(run(state, gen, sink)) as deltas:
        async for _ in deltas:
            pass


async def deltas_of_all(
    state: ServerState, gens: list[Generation], sinks: list[asyncio.Queue]
) -> AsyncIterator[tuple[int, Delta]]:
    """(prompt index, delta) as each prompt's deltas come; leaving early aborts every prompt
    still running (each run closes its own request). An engine failure is raised here."""
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int) -> None:
        try:
            async with aclosing(run(state, gens[i], sinks[i])) as deltas:
                async for delta in deltas:
                    await merged.put((i, delta))
        except EngineFailure as err:
            await merged.put((i, err))
        await merged.put((i, done))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(gens))]
    try:
        left = len(tasks)
        while left:
            i, item = await merged.get()
            if item is done:
                left -= 1
            elif isinstance(item, EngineFailure):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def batch_body(shape: Shape, gens: list[Generation], tok: Tokenizer) -> dict:
    """Every prompt's choices in OpenAI's order; usage over all of them."""
    body = final_body(shape, gens[0], tok)
    n = len(gens[0].choices)
    for i, gen in enumerate(gens[1:], start=1):
        for choice in final_body(shape, gen, tok)["choices"]:
            body["choices"].append({**choice, "index": i * n + choice["index"]})
    prompt = sum(len(g.prompt_ids) for g in gens)
    completion = sum(g.num_tokens for g in gens)
    body["usage"] = usage(prompt, completion, sum(g.cached_tokens for g in gens))
    return body


def batch_usage(gens: list[Generation]) -> dict:
    prompt = sum(len(g.prompt_ids) for g in gens)
    return usage(prompt, sum(g.num_tokens for g in gens), sum(g.cached_tokens for g in gens))


async def batch_events(
    state: ServerState, shape: Shape, gens: list[Generation], sinks: list[asyncio.Queue]
) -> AsyncIterator[str]:
    """The SSE chunks of every prompt, interleaved as they come, each with its global index."""
    tok = state.loop.engine.tokenizer
    quiet = shape.num_logprobs is None and not shape.return_token_ids
    n = len(gens[0].choices)
    started: set[int] = set()
    echoes: dict[int, object] = {}
    try:
        async with aclosing(deltas_of_all(state, gens, sinks)) as deltas:
            async for i, delta in deltas:
                index = i * n + delta.index
                first = index not in started
                if first or delta.text or delta.finish_reason is not None or not quiet:
                    started.add(index)
                    if shape.echo and i not in echoes:
                        echoes[i] = echo_of(gens[i], tok, shape.num_logprobs is not None)
                    body = chunk_body(shape, delta, tok, echoes.get(i), first, gens[i])
                    body["choices"][0]["index"] = index
                    yield sse(body)
    except EngineFailure as err:
        yield sse(error_body(str(err), err.kind))
    if shape.include_usage:
        chunk = {k: v for k, v in chunk_body(shape, _empty(), tok).items() if k != "choices"}
        yield sse({**chunk, "choices": [], "usage": batch_usage(gens)})
    yield sse("[DONE]")


def _empty() -> Delta:
    return Delta(0, "", [], None, None)
