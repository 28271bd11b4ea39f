"""Server CPU per output token: incremental detokenisation and stop strings must cost the same per
token at 100 and at 4000 tokens (re-decoding the whole output on every token made it quadratic).

    python bench/serve_tokens.py [--rounds 5] [--stops 4] [--logprobs]

Drives the server's per-token path (`Generation.advance`: detokenise, hold back a possible stop
string, look for stop strings, slice logprobs) with a fake engine stream, one token per output,
built before timing; the engine's own per-step cost is not in it. The text mixes ASCII with 2-, 3-
and 4-byte characters (the byte tokenizer splits them); the stop strings start like the text but
never match, so a tail is held back and every token is checked. As a peer in the same run: the old
scheme (decode the whole output, emit what is new) on the same tokens. Rounds interleave lengths
and peers; each measurement streams ~8000 tokens (80 outputs of 100, or 2 of 4000). Prints min
and median microseconds per token over the rounds, and the 4000/100 ratio: flat is near 1.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from kvpage.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpage.model.tokenizer import ByteTokenizer
from kvpage.sampling_params import SamplingParams
from kvpage.server.generation import Generation

LENGTHS = (100, 4000)
TOKENS_PER_MEASUREMENT = 8000
TEXT = "The naïve café served 世界 food 🙂 to everyone, again and again. "
TOKENIZER = ByteTokenizer()


def fake_stream(n: int, logprobs: bool) -> list[RequestOutput]:
    """One engine output per token; the last one finishes the request. The outputs share the
    whole token and logprob lists (the server reads only their tails, and checks no values), so
    building them costs no quadratic memory."""
    ids = list((TEXT * (n // len(TEXT) + 1)).encode())[:n]
    metrics = RequestMetrics(0.0, 0.0, 0.0, 0, 0)
    lps = [{t: -0.5, (t + 1) % 256: -1.5} for t in ids] if logprobs else None
    running = CompletionOutput(0, ids, "", lps, None)
    done = CompletionOutput(0, ids, "", lps, "length")
    outs = [RequestOutput("bench", [1], [running], False, metrics, [t]) for t in ids[:-1]]
    return [*outs, RequestOutput("bench", [1], [done], True, metrics, ids[-1:])]


def server_path(outputs: list[RequestOutput], stops: list[str]) -> None:
    gen = Generation.new(
        "bench", [1], SamplingParams(max_tokens=len(outputs)), None, TOKENIZER, stops
    )
    for out in outputs:
        gen.advance(out)
    assert gen.finished and not gen.choices[0].text.stopped


def full_redecode(outputs: list[RequestOutput], stops: list[str]) -> None:
    """The old scheme: decode everything so far on every token and emit what is new."""
    ids: list[int] = []
    sent = ""
    for out in outputs:
        ids.extend(out.new_token_ids)
        text = TOKENIZER.decode(ids)
        start = max(0, len(sent) - max(len(s) for s in stops))
        assert not any(text.find(s, start) >= 0 for s in stops)
        end = len(text)
        while end > len(sent) and text[end - 1] == "\ufffd":
            end -= 1
        sent = text[:end] if end > len(sent) else sent


def per_token_us(fn: Callable, streams: list[list[RequestOutput]], stops: list[str]) -> float:
    start = time.perf_counter()
    for outputs in streams:
        fn(outputs, stops)
    tokens = sum(len(s) for s in streams)
    return (time.perf_counter() - start) / tokens * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stops", type=int, default=4, help="stop strings per request (max 16)")
    ap.add_argument("--logprobs", action="store_true", help="two logprobs per token as well")
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be >= 3")
    # Each stop string starts like the text, so a long tail is held back and re-checked often.
    stops = [f" again and again. #{i}" + "x" * 30 for i in range(args.stops)] or ["\x00never"]
    streams = {n: [fake_stream(n, args.logprobs)] * (TOKENS_PER_MEASUREMENT // n) for n in LENGTHS}
    peers = {"server (incremental)": server_path, "old: full re-decode": full_redecode}
    samples: dict[tuple[str, int], list[float]] = {(p, n): [] for p in peers for n in LENGTHS}
    for _ in range(args.rounds):  # interleaved, so drift hits every cell alike
        for name, fn in peers.items():
            for n in LENGTHS:
                samples[name, n].append(per_token_us(fn, streams[n], stops))
    print(
        f"{args.rounds} rounds (interleaved), {len(stops)} stop strings of up to "
        f"{max(map(len, stops))} chars, logprobs {'on' if args.logprobs else 'off'}; "
        f"~{TOKENS_PER_MEASUREMENT} tokens per measurement; microseconds per token"
    )
    lo, hi = LENGTHS
    print(f"{'path':<22}{'tokens':>7}{'min':>9}{'median':>9}")
    for name in peers:
        for n in LENGTHS:
            s = samples[name, n]
            print(f"{name:<22}{n:>7}{min(s):>9.2f}{statistics.median(s):>9.2f}")
    for name in peers:
        a, b = samples[name, lo], samples[name, hi]
        print(
            f"{name}: per-token cost {hi}/{lo} = {min(b) / min(a):.2f}x (min), "
            f"{statistics.median(b) / statistics.median(a):.2f}x (median); flat is ~1"
        )


if __name__ == "__main__":
    main()
