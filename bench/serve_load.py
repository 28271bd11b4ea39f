"""Load test of the OpenAI-compatible server on loopback: N streaming clients for a bounded time.

    python bench/serve_load.py [--clients 16] [--seconds 20] [--max-tokens 64] [--url URL]
                               [--model builtin:tiny-llama] [--num-blocks 256] [--families 4]

Without --url it starts its own server in this process (uvicorn in a thread, same engine defaults as
`kvpage serve`); with --url it drives that server. Each client sends streamed completions back to
back: a prompt from one of `--families` shared 48-byte system prefixes (so the prefix cache is
used) plus a unique tail, greedy, EOS ignored. When the time is up, requests in flight finish and the
script prints requests/s, output tokens/s, TTFT and inter-token latency percentiles (client side:
from sending the request / between token-carrying chunks), the server's prefix hit rate and
preemptions, and checks on /metrics that no KV block leaked (no private or shared block, no request
left, once idle). Exit status 1 if a block leaked or a request failed."""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class ClientStats:
    requests: int = 0
    failures: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def _prompt(client: int, n: int, families: int) -> str:
    head = f"System prompt family {client % families}: answer briefly, in bytes. "[:48]
    return f"{head.ljust(48, '.')} Client {client} request {n}: go."


def _one_request(http: httpx.Client, url: str, body: dict, stats: ClientStats) -> None:
    last = time.perf_counter()  # TTFT counts from sending the request
    got = 0
    with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            stats.failures += 1
            r.read()
            return
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids", [])
            if ids:
                now = time.perf_counter()
                (stats.itl if got else stats.ttft).append(now - last)
                last, got = now, got + len(ids)
    stats.requests += 1
    stats.tokens += got


def _client(i: int, url: str, args, deadline: float, stats: ClientStats) -> None:
    with httpx.Client(timeout=120) as http:
        n = 0
        while time.monotonic() < deadline:
            body = {
                "prompt": _prompt(i, n, args.families),
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            try:
                _one_request(http, url, body, stats)
            except httpx.HTTPError:
                stats.failures += 1
            n += 1


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            label = ",".join(f"{v}" for _, v in sorted(s.labels.items()))
            out[f"{s.name}[{label}]" if label else s.name] = s.value
    return out


def _idle_metrics(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        busy = m["kvpage_requests[running]"] + m["kvpage_requests[waiting]"]
        if not busy or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def _local_server(args):
    import torch

    from kvpage import EngineConfig, LLMEngine
    from kvpage.server import ServerOptions, create_app
    from kvpage.server.background import BackgroundServer

    torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineConfig(model=args.model, num_blocks=args.num_blocks, max_num_seqs=args.clients)
    )
    options = ServerOptions(model_name=args.model, shadow_rate=args.shadow_rate)
    return BackgroundServer(create_app(engine, options))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="an already running server (default: start one here)")
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--families", type=int, default=4, help="distinct shared prompt prefixes")
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the local server")
    p.add_argument("--shadow-rate", type=float, default=0.01)
    args = p.parse_args()

    with _local_server(args) if args.url is None else nullcontext() as local:
        url = args.url or local.url
        where = "in-process server" if args.url is None else url
        print(
            f"serve_load: {args.clients} clients x {args.seconds:.0f} s, {where}, {args.model}, "
            f"max_tokens {args.max_tokens}, {args.families} prefix families"
        )
        before = _metrics(url)
        stats = [ClientStats() for _ in range(args.clients)]
        deadline = time.monotonic() + args.seconds
        start = time.perf_counter()
        threads = [
            threading.Thread(target=_client, args=(i, url, args, deadline, stats[i]))
            for i in range(args.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        after = _idle_metrics(url)
    return _report(stats, wall, before, after)


def _report(stats: list[ClientStats], wall: float, before: dict, after: dict) -> int:
    reqs = sum(s.requests for s in stats)
    fails = sum(s.failures for s in stats)
    tokens = sum(s.tokens for s in stats)
    ttft = [x for s in stats for x in s.ttft]
    itl = [x for s in stats for x in s.itl]
    grew = lambda k: after[k] - before.get(k, 0)  # noqa: E731
    queries = grew("kvpage_prefix_cache_queries_tokens_total")
    hits = grew("kvpage_prefix_cache_hits_tokens_total")
    print(
        f"requests {reqs} ok, {fails} failed in {wall:.1f} s: {reqs / wall:.2f} req/s, "
        f"{tokens / wall:.0f} output tokens/s"
    )
    for name, xs in (("TTFT", ttft), ("inter-token", itl)):
        p50, p90, p99 = (1000 * _pct(xs, q) for q in (50, 90, 99))
        print(f"{name:>11} ms: p50 {p50:7.2f}  p90 {p90:7.2f}  p99 {p99:7.2f}  (n={len(xs)})")
    pre = grew("kvpage_preemptions_total[recompute]") + grew("kvpage_preemptions_total[swap]")
    print(
        f"prefix hit rate {hits / max(queries, 1):.1%} of {queries:.0f} prompt tokens; "
        f"preemptions {pre:.0f}"
    )
    private, shared = after["kvpage_kv_blocks[private]"], after["kvpage_kv_blocks[shared]"]
    left = after["kvpage_requests[running]"] + after["kvpage_requests[waiting]"]
    leaked = private or shared or left
    print(
        f"blocks once idle: free {after['kvpage_kv_blocks[free]']:.0f}, cached "
        f"{after['kvpage_kv_blocks[cached]']:.0f}, private {private:.0f}, shared {shared:.0f}; "
        f"requests left {left:.0f} -> {'LEAK' if leaked else 'no block leaked'}"
    )
    return 1 if leaked or fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
