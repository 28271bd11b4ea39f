"""32 concurrent streaming clients on a 64-block pool (so requests preempt each other); a third
hang up at random points (seeded). Every other client gets exactly the offline tokens, and once the
server is idle every block is free or cached: nothing leaked."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from kvpage import SamplingParams

from .conftest import MODEL

NUM_CLIENTS = 32
MAX_TOKENS = 40


def _prompt(i: int) -> str:
    # Shared 32-byte head (two cached blocks once published), then a per-client tail.
    return f"System: you are a paged KV cache. Client {i:02d} asks question {i * 7 % 13}?"


def _client_run(server, i: int, hang_up_after: int | None) -> list[int] | None:
    client = server.client()
    seed = {"seed": 100 + i, "temperature": 0.8} if i % 2 else {"temperature": 0.0}
    stream = client.completions.create(
        model=MODEL,
        prompt=_prompt(i),
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"return_token_ids": True},
        **seed,
    )
    ids: list[int] = []
    for chunk in stream:
        ids.extend(chunk.choices[0].model_extra["token_ids"])
        if hang_up_after is not None and len(ids) >= hang_up_after:
            stream.close()  # drops the connection mid-stream
            return None
    return ids


def test_concurrent_streams_with_disconnects(open_server, offline):
    rng = random.Random(7)
    quitters = set(rng.sample(range(NUM_CLIENTS), NUM_CLIENTS // 3))
    hang_up = {i: rng.randint(1, MAX_TOKENS - 5) if i in quitters else None for i in range(32)}
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=100 + i)
        if i % 2
        else SamplingParams(max_tokens=MAX_TOKENS)
        for i in range(NUM_CLIENTS)
    ]
    prompts = [_prompt(i) for i in range(NUM_CLIENTS)]
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    before = open_server.admin("stats")

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        futures = [pool.submit(_client_run, open_server, i, hang_up[i]) for i in range(32)]
        results = [f.result(timeout=120) for f in futures]

    for i, got in enumerate(results):
        if i not in quitters:
            assert got == expected[i], f"client {i}"
    stats = open_server.wait_idle()
    assert stats["running"] == stats["waiting"] == stats["swapped"] == 0
    assert stats["private_blocks"] == stats["shared_blocks"] == 0, stats
    assert stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]
    aborted = stats["aborts"] - before["aborts"]
    print(f"aborted {aborted} of {len(quitters)} quitters")
    assert aborted <= len(quitters)  # one whose last token was already out had finished
    assert stats["preemptions"] > before["preemptions"]  # the pool really was contended


def test_disconnect_aborts_the_request(open_server):
    """A long stream dropped after two chunks is aborted at once, not run to max_tokens."""
    before = open_server.wait_idle()
    stream = open_server.client().completions.create(
        model=MODEL,
        prompt="hang up on me",
        max_tokens=1000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    stats = open_server.wait_idle()
    assert stats["aborts"] == before["aborts"] + 1
    assert stats["private_blocks"] == stats["shared_blocks"] == 0
