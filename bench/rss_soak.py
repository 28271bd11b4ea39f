"""RSS soak of the server (or the engine alone): streams with n > 1 opened and abandoned, and
what memory does meanwhile.

    python bench/rss_soak.py [--requests 1000] [--rounds 2] [--every 100] [--clients 1] [--n 3]
                             [--max-tokens 64] [--warmup 50] [--tracemalloc] [--no-trim]
    python bench/rss_soak.py --engine-only [--clients 16] [--prompt-tokens 4-96] [--linger 2]
                             [--seed 0] [--fast-paths-off onednn,...|all] ...
    MALLOC_ARENA_MAX=2 python bench/rss_soak.py ...   # glibc: two malloc arenas, not 8 per core
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 LRU_CACHE_CAPACITY=1 python bench/rss_soak.py ...

Server mode starts the server in this process (uvicorn in a thread, `builtin:tiny-llama`, the
engine and shadow defaults of `kvpage serve`), then, `--clients` at a time, sends a streamed
completion with `n` samples, reads up to its first event and closes the connection, so the
server aborts it. `--engine-only` drives kvpage.LLMEngine itself with the same traffic and no
HTTP, server or shadow (_EngineDriver: `--clients` requests in flight, prompts of random token
ids, each aborted with `abort_request` 0 to `--linger` steps after its first token, as the engine
loop aborts a stream whose client hung up), so the steps' batch shapes vary as under concurrent
streams; `--fast-paths-off` binds the engine's model without them (kvpage.model.kernels.finalize). Every `--every`
requests, once the engine is idle, it prints RSS (VmRSS and RssAnon from /proc/self/status),
malloc's bytes in use and held free (glibc's mallinfo2), the live Python objects after a full
collection (and, with --tracemalloc, the bytes Python allocated and still holds), the engine's
free and cached KV blocks and its live requests, the server's per-request state (the engine
loop's sinks, the audit log's tenants), the decode shapes the decode tape keeps
(`plan`: kvpage's only per-shape store, at most kvpage.model.decode_tape.MAX_TAPES) and the distinct step sizes run so far (`shapes`: tokens per forward pass). After
each round it prints the round's growth per 1,000 requests and the object types that grew most.

Telling a leak from allocator retention from a cache: a leak holds Python objects (or tensors)
that a request left behind, so object counts and per-request state grow with the requests, round
after round; retention is memory freed by Python and torch that glibc keeps in its arenas ("held
free" grows), and `malloc_trim(0)` at the end (skipped with --no-trim) hands much of it back.
Growth in "malloc used" with flat Python objects and traced bytes is native memory still
allocated: a C++ cache (it follows `shapes` and stops when the cache is full) or a leak (it goes
on with the requests). Found so far (bench/README.md, issue 40): it is two bounded caches of
compiled oneDNN primitives, one per (rows, weight shape) of kvpage's prepacked linear layers
(`torch.ops.mkldnn._linear_pointwise`): oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY,
1024 entries by default) and ideep's LRU of computations inside torch (LRU_CACHE_CAPACITY, 1024; 0
crashes torch, 1 is the smallest). With both off, or with `--fast-paths-off onednn`, RSS is flat;
with the defaults, `--engine-only --clients 16` levels off at ~1,040 MiB RSS (~660 MiB malloc
used) after ~3,000 requests, once oneDNN has created ~1,024 primitives (ONEDNN_VERBOSE=
profile_create counts them)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
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
    plan_rows: int  # decode shapes the decode tape keeps a tape (its activations) for
    shapes: int  # distinct step sizes (tokens a forward pass ran) seen so far


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


def _plan_rows(engine) -> int:
    """The shapes the model's decode tape keeps (0: no tape built)."""
    tape = getattr(engine.model, "decode_plan", lambda: None)()
    return 0 if tape is None else tape.kept


SHAPES: set[int] = set()  # the token counts of the forward passes run so far


def _count_shapes(engine) -> None:
    engine.model.register_forward_pre_hook(lambda _m, args: SHAPES.add(args[0].shape[0]))


def _sample(done: int, engine, state, traced: bool) -> Sample:
    if state is not None:
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
        state.loop.in_flight if state is not None else 0,
        len(state.audit.tenants) + len(state.audit.adapters) if state is not None else 0,
        _plan_rows(engine),
        len(SHAPES),
    )


def _print(x: Sample) -> None:
    print(
        f"{x.requests:6d} {x.rss:8.1f} {x.anon:8.1f} {x.used:8.1f} {x.held_free:8.1f} "
        f"{x.objects:9d} {x.traced:8.2f} "
        f"{x.free_blocks:5d} {x.cached_blocks:6d} {x.live_requests:5d} {x.sinks:5d} "
        f"{x.tenants:7d} {x.plan_rows:5d} {x.shapes:6d}"
    )


def _types() -> Counter:
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def _round(r: int, args, send, engine, state, start: int) -> tuple[Sample, Sample, Counter]:
    """One round of args.requests: send(batch) -> requests refused, then a sample."""
    before_types = _types()
    first = _sample(start, engine, state, args.tracemalloc)
    _print(first)
    failed = 0
    last = first
    for at in range(start, start + args.requests, args.every):
        batch = range(at, min(at + args.every, start + args.requests))
        failed += send(batch)
        last = _sample(batch[-1] + 1, engine, state, args.tracemalloc)
        _print(last)
    grew = _types()
    grew.subtract(before_types)
    per_k = 1000 / args.requests
    print(
        f"round {r}: RSS {first.rss:.1f} -> {last.rss:.1f} MiB "
        f"({(last.rss - first.rss) * per_k:+.1f} MiB per 1,000 requests), malloc used "
        f"{first.used:.1f} -> {last.used:.1f} MiB, objects "
        f"{(last.objects - first.objects) * per_k:+.0f} per 1,000, {failed} requests refused"
    )
    return first, last, grew


class _EngineDriver:
    """--engine-only: the server's traffic without the server. `clients` requests in flight on
    the engine itself, each n samples of a prompt of random token ids (--prompt-tokens lengths),
    aborted as the engine loop aborts a stream whose client hung up (abort_request) once a
    sample's first token is out, after 0 to --linger more steps (the server's abort lands a
    step or two late), so the steps' batch shapes vary as under concurrent HTTP streams."""

    def __init__(self, engine, args) -> None:
        from kvpage import SamplingParams

        self.engine, self.args, self.rng = engine, args, random.Random(args.seed)
        self.params = SamplingParams
        self.vocab = engine.model.config.vocab_size
        lo, _, hi = args.prompt_tokens.partition("-")
        self.lengths = (int(lo), int(hi or lo))

    def _add(self, i: int) -> str:
        rid = f"soak-{i}"
        prompt = [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(*self.lengths))]
        a = self.args
        params = self.params(
            n=a.n, max_tokens=a.max_tokens, temperature=0.8, seed=i, ignore_eos=True, logprobs=1
        )
        self.engine.add_request(rid, prompt, params)
        return rid

    def __call__(self, batch: range) -> int:
        engine, todo = self.engine, list(batch)[::-1]
        live: dict[str, int | None] = {}  # request id -> steps left before its abort
        while todo or live or engine.has_unfinished_requests():
            while todo and len(live) < self.args.clients:
                live[self._add(todo.pop())] = None
            for out in engine.step():
                rid = out.request_id.partition("#")[0]
                if out.finished:
                    live.pop(rid, None)
                elif live.get(rid, 0) is None and any(c.token_ids for c in out.outputs):
                    live[rid] = self.rng.randint(0, self.args.linger)
            for rid, left in list(live.items()):
                if left == 0:
                    engine.abort_request(rid)
                    del live[rid]
                elif left is not None:
                    live[rid] = left - 1
        return 0


def _engine(args):
    import torch

    from kvpage import EngineConfig, LLMEngine

    torch.set_num_threads(args.threads)
    return LLMEngine(EngineConfig(model=args.model, num_blocks=args.num_blocks))


def _local_server(args):
    import torch

    from kvpage import EngineConfig, LLMEngine
    from kvpage.server import ServerOptions, create_app
    from kvpage.server.background import BackgroundServer

    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, num_blocks=args.num_blocks))
    _count_shapes(engine)
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
    p.add_argument(
        "--engine-only",
        action="store_true",
        help="drive kvpage.LLMEngine directly: no HTTP, no server, no shadow",
    )
    p.add_argument("--prompt-tokens", default="4-96", help="--engine-only: prompt lengths LO-HI")
    p.add_argument(
        "--linger",
        type=int,
        default=2,
        help="--engine-only: most steps a request runs on after its first token",
    )
    p.add_argument("--seed", type=int, default=0, help="--engine-only: prompts and lingers")
    p.add_argument(
        "--fast-paths-off",
        default="",
        help="--engine-only: kvpage.model.kernels paths off (comma-separated; 'all')",
    )
    args = p.parse_args()
    env = {
        k: os.environ[k]
        for k in os.environ
        if k.startswith(("MALLOC_", "ONEDNN_", "DNNL_", "MKL_", "KVPAGE_", "LRU_"))
    }
    mode = "engine only" if args.engine_only else "server"
    print(
        f"rss_soak ({mode}): {args.rounds} x {args.requests} abandoned streams, n={args.n}, "
        f"{args.clients} at once, {args.model}, env {env or 'default'}"
    )
    if args.tracemalloc:
        tracemalloc.start()
    header = (
        "  reqs  RSS MiB anon MiB malloc used  free   objects  traced  free cached  live "
        "sinks tenants  plan shapes"
    )
    if args.engine_only:
        return _engine_main(args, header)
    server, engine, state = _local_server(args)
    print(f"KV pool: {engine.cache.pool.num_blocks} blocks; shadow rate {args.shadow_rate}")
    with server:
        port = server.port

        def send(batch: range) -> int:
            with ThreadPoolExecutor(args.clients) as pool:
                ok = pool.map(lambda i: _abandon(port, _body(i, args)), batch)
                return sum(not x for x in ok)

        for i in range(args.warmup):
            _abandon(port, _body(-1 - i, args))
        print(header)
        done, rounds = 0, []
        for r in range(1, args.rounds + 1):
            rounds.append(_round(r, args, send, engine, state, done))
            done += args.requests
        _report(rounds, args)
    return 0


def _engine_main(args, header: str) -> int:
    from kvpage.model.kernels import FAST_PATHS, finalize

    engine = _engine(args)
    _count_shapes(engine)
    off = (
        FAST_PATHS
        if args.fast_paths_off == "all"
        else tuple(filter(None, args.fast_paths_off.split(",")))
    )
    print(f"KV pool: {engine.cache.pool.num_blocks} blocks; fast paths off: {off or 'none'}")
    drive = _EngineDriver(engine, args)
    finalize(engine.model, off)
    drive(range(-args.warmup, 0))
    print(header)
    done, rounds = 0, []
    for r in range(1, args.rounds + 1):
        rounds.append(_round(r, args, drive, engine, None, done))
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
