"""The client side of `serving.py`: a request stream sent to an OpenAI-compatible server through
the `openai` client, each request at its arrival time, streamed, timed per chunk.

Every request is a streamed `/v1/completions` call with the prompt as token ids, `max_tokens`,
temperature 0, `ignore_eos` (vLLM's extension, which llama-server and kvpage take too) and
`stream_options.include_usage`, whose last chunk carries the server's own token counts. A
request that ends with other than `max_tokens` output tokens counts as failed: every server must
do the same work.
"""

from __future__ import annotations

import asyncio
import time

from openai import AsyncOpenAI
from serving_metrics import RequestRecord
from serving_workload import StreamRequest


async def _one(client: AsyncOpenAI, model: str, req: StreamRequest, start: float) -> RequestRecord:
    delay = start + req.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)  # the request's arrival time, not a wait for a server
    rec = RequestRecord(sent=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model,
            prompt=req.prompt,
            max_tokens=req.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                rec.token_times.append(now)
            if chunk.usage is not None:
                rec.output_tokens = chunk.usage.completion_tokens
                rec.prompt_tokens = chunk.usage.prompt_tokens
        rec.done = time.perf_counter()
    except Exception as err:  # a failed request is counted, the stream goes on
        rec.error = f"{type(err).__name__}: {err}"[:300]
        return rec
    if rec.output_tokens != req.max_tokens:
        rec.error = f"{rec.output_tokens} output tokens (usage), {req.max_tokens} asked"
    return rec


async def _send_all(
    url: str, model: str, stream: list[StreamRequest], timeout_s: float
) -> tuple[list[RequestRecord], float]:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout_s)
    try:
        start = time.perf_counter()
        tasks = [_one(client, model, req, start) for req in stream]
        return list(await asyncio.gather(*tasks)), start
    finally:
        await client.close()


def send_stream(
    url: str, model: str, stream: list[StreamRequest], timeout_s: float = 900.0
) -> tuple[list[RequestRecord], float]:
    """Sends `stream` (each request at its arrival offset) and waits for every answer; the
    records in the stream's order and the stream's start, on `time.perf_counter`'s clock."""
    return asyncio.run(_send_all(url, model, stream, timeout_s))
