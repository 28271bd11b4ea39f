"""The request stream of `serving.py`: Poisson arrivals at a rate, token-id prompts of mixed
lengths, fixed output lengths, a share of requests opening with one common system prompt.

Pure Python, no third-party imports (tests/bench checks it without any server). Every server
gets the same stream: prompts are token ids (sent as a list of ints, so no tokenizer decides a
prompt's length) and each request's output length is fixed (max_tokens with EOS ignored).

Full stream (per rate): prompts of 64-1024 tokens, outputs of 16-256, 20% of the requests a
512-token system prompt + a unique tail of 64-512 tokens (so they too stay within 64-1024).
Each rate has its own seeded generator and its own system prompt, so no rate is served from the
prefix cache another rate filled, whatever the order they run in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_TOKEN_ID = 3  # prompts avoid pad (0), bos (1) and eos (2)


@dataclass(frozen=True, slots=True)
class StreamShape:
    """What a stream is drawn from; the bounds are inclusive."""

    requests: int = 100
    prompt_min: int = 64
    prompt_max: int = 1024
    output_min: int = 16
    output_max: int = 256
    shared_fraction: float = 0.2
    system_tokens: int = 512
    tail_min: int = 64  # a shared request's unique tail after the system prompt
    tail_max: int = 512

    def __post_init__(self) -> None:
        if not 0 <= self.shared_fraction <= 1:
            raise ValueError(f"shared_fraction {self.shared_fraction} is not in [0, 1]")
        if self.system_tokens + self.tail_max > self.prompt_max and self.shared_fraction > 0:
            raise ValueError("a shared prompt (system + tail) would exceed prompt_max")
        if self.requests < 1 or self.prompt_min < 1 or self.output_min < 1:
            raise ValueError("requests, prompt_min and output_min must be >= 1")

    @property
    def max_context(self) -> int:
        """The most tokens one request holds: its longest prompt and output."""
        return self.prompt_max + self.output_max


@dataclass(frozen=True, slots=True)
class StreamRequest:
    arrival_s: float  # when it is sent, from the stream's start
    prompt: list[int]
    max_tokens: int
    shared: bool  # opens with the stream's system prompt


def poisson_arrivals(rng: random.Random, rate: float, n: int) -> list[float]:
    """`n` arrival times (s) of a Poisson process of `rate` per second: exponential gaps of mean
    1/rate, the first one included (the stream does not start with a request at 0)."""
    if rate <= 0:
        raise ValueError(f"rate {rate} must be > 0")
    times, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


def make_stream(rate: float, shape: StreamShape, vocab: int, seed: int) -> list[StreamRequest]:
    """The stream for one rate. Its generator is seeded by (seed, rate), so a rate's stream does
    not depend on which other rates run; which requests share the system prompt is an exact
    count (round(fraction x requests)), placed at random."""
    rng = random.Random(f"{seed}:{rate!r}")
    system = _tokens(rng, shape.system_tokens, vocab)
    n_shared = round(shape.shared_fraction * shape.requests)
    shared = set(rng.sample(range(shape.requests), n_shared))
    arrivals = poisson_arrivals(rng, rate, shape.requests)
    stream = []
    for i, at in enumerate(arrivals):
        if i in shared:
            prompt = system + _tokens(rng, rng.randint(shape.tail_min, shape.tail_max), vocab)
        else:
            prompt = _tokens(rng, rng.randint(shape.prompt_min, shape.prompt_max), vocab)
        out = rng.randint(shape.output_min, shape.output_max)
        stream.append(StreamRequest(at, prompt, out, i in shared))
    return stream


def warmup_stream(shape: StreamShape, vocab: int, seed: int, n: int = 8) -> list[StreamRequest]:
    """`n` requests sent at once, of lengths spread over the stream's range and short outputs,
    with tokens of their own (nothing a timed stream could find cached)."""
    rng = random.Random(f"{seed}:warm-up")
    span = shape.prompt_max - shape.prompt_min
    lengths = [shape.prompt_min + span * i // max(n - 1, 1) for i in range(n)]
    return [StreamRequest(0.0, _tokens(rng, p, vocab), shape.output_min, False) for p in lengths]
