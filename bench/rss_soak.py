"""RSS soak of the server: streams with n > 1 opened and abandoned, and what memory does meanwhile.

    python bench/rss_soak.py [--requests 1000] [--rounds 2] [--every 100] [--n 3]
                             [--max-tokens 64] [--warmup 50] [--tracemalloc] [--no-trim]
    MALLOC_ARENA_MAX=2 python bench/rss_soak.py ...   # glibc: two malloc arenas, not 8 per core

Starts the server in this process (uvicorn in a thread, `builtin:tiny-llama`, the engine and
shadow defaults of `kvpage serve`), then, `--clients` at a time, sends a streamed completion with `n` samples, reads up to its first event and closes
the connection, so the server aborts it. Every `--every` requests, once the engine is idle, it
prints RSS (VmRSS and RssAnon from /proc/self/status), malloc's bytes in use and held free
(glibc's mallinfo2), the live Python objects after a full collection (and, with --tracemalloc, the bytes Python allocated and still holds), the engine's
free and cached KV blocks and its live requests, and the server's per-request state (the engine
loop's sinks, the audit log's tenants). After each round it prints the round's growth per 1,000
requests and the object types that grew most.

Telling a leak from allocator retention: a leak holds Python objects (or tensors) that a request
left behind, so object counts and per-request state grow with the requests, round after round;
retention is memory freed by Python and torch that glibc keeps in its arenas ("held free"
grows), so objects stay flat, growth slows down in later rounds, and `malloc_trim(0)` at the
end (skipped with --no-trim) hands much of it back. Growth in "malloc used" with flat Python
objects and traced bytes is native memory still allocated (a C++ cache or leak). Run it twice, with and without MALLOC_ARENA_MAX=2: retention
in per-thread arenas shrinks with fewer arenas, a leak does not."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import time
import tracemalloc
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MIB = 1024 * 1024
LIBC = ctypes.CDLL("libc.so.6")


class _Mallinfo2(ctypes.Structure):
    """glibc's mallinfo2 (2.33+): what malloc holds, and how much of it is in use."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


LIBC.mallinfo2.restype = _Mallinfo2


def malloc_mib() -> tuple[float, float]:
    """(bytes malloc has handed out and not had back, bytes it holds free), in MiB, all arenas
    and mmapped chunks: a leak grows the first, allocator retention the second."""
    info = LIBC.mallinfo2()
    return (info.uordblks + info.hblkhd) / MIB, info.fordblks / MIB


@dataclass
class Sample:
    requests: int
    rss: float  # MiB
    anon: float  # MiB
    used: float  # MiB malloc handed out (mallinfo2)
    held_free: float  # MiB malloc keeps free
    objects: int
    traced: float  # MiB Python holds (tracemalloc), 0 without it
    free_blocks: int
    cached_blocks: int
    live_requests: int
    sinks: int
    tenants: int


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _abandon(port: int, body: bytes) -> bool:
    """One streamed request, closed after its first event (as a client that gives up)."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head + body)
        got = b""
        while b"\ndata: " not in got:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    return got.startswith(b"HTTP/1.1 200")


def _body(i: int, args) -> bytes:
    return json.dumps(
        {
            "prompt": f"Abandoned stream {i}: tell the longest story you know.",
            "max_tokens": args.max_tokens,
            "n": args.n,
            "temperature": 0.8,
            "seed": i,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 1,
        }
    ).encode()


def _idle(engine, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if not (s["running"] or s["waiting"] or s["swapped"] or s["private_blocks"]):
            return
        time.sleep(0.02)  # a poll interval: aborts are carried out between engine steps
    raise RuntimeError(f"engine not idle after {timeout:g} s: {engine.stats()}")


def _sample(done: int, engine, state, traced: bool) -> Sample:
    _idle(engine)
    time.sleep(0.2)  # the audit log forgets a request's tenant just after its last event
    gc.collect()
    s = engine.stats()
    return Sample(
        done,
        _status_mib("VmRSS"),
        _status_mib("RssAnon"),
        *malloc_mib(),
        len(gc.get_objects()),
        tracemalloc.get_traced_memory()[0] / MIB if traced else 0.0,
        s["free_blocks"],
        s["cached_blocks"],
        len(engine.seqs) + len(engine.samples),
        state.loop.in_flight,
        len(state.audit.tenants) + len(state.audit.adapters),
    )


def _print(x: Sample) -> None:
    print(
        f"{x.requests:6d} {x.rss:8.1f} {x.anon:8.1f} {x.used:8.1f} {x.held_free:8.1f} "
        f"{x.objects:9d} {x.traced:8.2f} "
        f"{x.free_blocks:5d} {x.cached_blocks:6d} {x.live_requests:5d} {x.sinks:5d} "
        f"{x.tenants:7d}"
    )


def _types() -> Counter:
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def _round(r: int, args, port: int, engine, state, start: int) -> tuple[Sample, Sample, Counter]:
    before_types = _types()
    first = _sample(start, engine, state, args.tracemalloc)
    _print(first)
    failed = 0
    last = first
    with ThreadPoolExecutor(args.clients) as pool:
        for at in range(start, start + args.requests, args.every):
            batch = range(at, min(at + args.every, start + args.requests))
            ok = pool.map(lambda i: _abandon(port, _body(i, args)), batch)
            failed += sum(not x for x in ok)
            last = _sample(batch[-1] + 1, engine, state, args.tracemalloc)
            _print(last)
    grew = _types()
    grew.subtract(before_types)
    per_k = 1000 / args.requests
    print(
        f"round {r}: RSS {first.rss:.1f} -> {last.rss:.1f} MiB "
        f"({(last.rss - first.rss) * per_k:+.1f} MiB per 1,000 requests), objects "
        f"{(last.objects - first.objects) * per_k:+.0f} per 1,000, {failed} requests refused"
    )
    return first, last, grew


def _local_server(args):
    import torch

    from kvpage import EngineConfig, LLMEngine
    from kvpage.server import ServerOptions, create_app
    from kvpage.server.background import BackgroundServer

    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, num_blocks=args.num_blocks))
    options = ServerOptions(
        model_name=args.model, shadow_rate=args.shadow_rate, audit_log=args.audit_log
    )
    app = create_app(engine, options)
    return BackgroundServer(app), engine, app.state.server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--requests", type=int, default=1000, help="abandoned streams per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--every", type=int, default=100, help="requests between two samples")
    p.add_argument("--warmup", type=int, default=50, help="requests before the first sample")
    p.add_argument("--n", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=None, help="default: as `kvpage serve`")
    p.add_argument("--shadow-rate", type=float, default=0.01, help="as `kvpage serve`")
    p.add_argument("--audit-log", default=None, help="a file (default: the log, as lines)")
    p.add_argument("--clients", type=int, default=1, help="streams opened at once")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--tracemalloc", action="store_true", help="also trace Python's allocations")
    p.add_argument("--no-trim", action="store_true", help="skip malloc_trim(0) at the end")
    args = p.parse_args()
    env = {k: os.environ[k] for k in os.environ if k.startswith("MALLOC_")}
    print(
        f"rss_soak: {args.rounds} x {args.requests} abandoned streams, n={args.n}, "
        f"{args.clients} at once, {args.model}, malloc env {env or 'default'}"
    )
    if args.tracemalloc:
        tracemalloc.start()
    server, engine, state = _local_server(args)
    print(f"KV pool: {engine.cache.pool.num_blocks} blocks; shadow rate {args.shadow_rate}")
    with server:
        port = server.port
        for i in range(args.warmup):
            _abandon(port, _body(-1 - i, args))
        print(
            "  reqs  RSS MiB anon MiB malloc used  free   objects  traced  free cached  live "
            "sinks tenants"
        )
        done, rounds = 0, []
        for r in range(1, args.rounds + 1):
            rounds.append(_round(r, args, port, engine, state, done))
            done += args.requests
        _report(rounds, args)
    return 0


def _report(rounds: list[tuple[Sample, Sample, Counter]], args) -> None:
    top = rounds[-1][2].most_common(6)
    print("object types grown most in the last round:", ", ".join(f"{t} {n:+d}" for t, n in top))
    used, held = malloc_mib()
    print(f"malloc: {used:.1f} MiB handed out, {held:.1f} MiB held free")
    gc.collect()
    before = _status_mib("VmRSS")
    if not args.no_trim:
        LIBC.malloc_trim(0)
        after = _status_mib("VmRSS")
        start = rounds[0][0].rss
        print(
            f"malloc_trim(0): RSS {before:.1f} -> {after:.1f} MiB "
            f"({before - after:.1f} MiB handed back; {before - start:.1f} MiB had grown)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
