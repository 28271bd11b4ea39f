"""Engine replicas on Ray Serve: prefix-affinity routing vs round-robin, in one invocation.

    python bench/replicas.py [--replicas 2] [--clients 8] [--conversations 16] [--turns 5]
                             [--shared-requests 64] [--max-tokens 16] [--model builtin:tiny-llama]

Starts a local Ray instance and two kvpage applications side by side (same model, same pool, N
replicas each): one behind the prefix-affinity router, one behind round-robin. Each workload is
sent, by `--clients` concurrent streaming clients, to one application at a time:

  multi-turn     conversations that grow turn by turn (each turn's prompt is the previous turn's
                 prompt + the reply + a new question); a client drives one conversation at a time
  shared-system  one long system prompt shared by every request, each with its own question

Per (workload, router): prefix hit rate (cached / prompt tokens, from each response's usage),
prefill tokens computed (prompt - cached), TTFT p50/p99 (request sent -> first streamed token)
and requests/s over the workload's wall time. Needs the `ray` extra."""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpage.config import EngineConfig  # noqa: E402
from kvpage.serve_replicas import ray_serve  # noqa: E402
from kvpage.serve_replicas.prefix_router import RouterConfig  # noqa: E402
from kvpage.server import ServerOptions  # noqa: E402

ROUTERS = ("prefix", "round-robin")
SYSTEM = (
    "You are the support assistant of a paged KV cache engine. Answer briefly, cite the block "
    "table when relevant, never invent numbers, and say when you do not know. "
)


@dataclass
class Result:
    prompt: int = 0
    cached: int = 0
    ttfts: list[float] = field(default_factory=list)
    requests: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Reply:
    text: str
    prompt: int
    cached: int
    ttft: float


def chat(url: str, messages: list[dict], max_tokens: int) -> Reply:
    """One streamed chat completion; TTFT is the first chunk that carries text."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, text, usage = time.perf_counter(), None, [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = httpx.Response(200, content=line[6:]).json()
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event.get("choices") or []:
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
            usage = event.get("usage") or usage
    details = usage["prompt_tokens_details"]
    ttft = (first or time.perf_counter()) - start
    return Reply("".join(text), usage["prompt_tokens"], details["cached_tokens"], ttft)


def multi_turn(args) -> list[Callable[[str], list[Reply]]]:
    def conversation(index: int) -> Callable[[str], list[Reply]]:
        def run(url: str) -> list[Reply]:
            messages = [{"role": "system", "content": f"Conversation {index}. {SYSTEM}"}]
            replies = []
            for turn in range(args.turns):
                messages.append(
                    {"role": "user", "content": f"Turn {turn}: what about block {index}?"}
                )
                reply = chat(url, messages, args.max_tokens)
                messages.append({"role": "assistant", "content": reply.text})
                replies.append(reply)
            return replies

        return run

    return [conversation(i) for i in range(args.conversations)]


def shared_system(args) -> list[Callable[[str], list[Reply]]]:
    def request(index: int) -> Callable[[str], list[Reply]]:
        def run(url: str) -> list[Reply]:
            messages = [
                {"role": "system", "content": SYSTEM * 3},
                {"role": "user", "content": f"Question {index}: why is block {index} shared?"},
            ]
            return [chat(url, messages, args.max_tokens)]

        return run

    return [request(i) for i in range(args.shared_requests)]


def run_workload(url: str, jobs: list[Callable[[str], list[Reply]]], clients: int) -> Result:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        replies = [r for batch in pool.map(lambda job: job(url), jobs) for r in batch]
    result = Result(seconds=time.perf_counter() - start, requests=len(replies))
    for r in replies:
        result.prompt += r.prompt
        result.cached += r.cached
        result.ttfts.append(r.ttft)
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_apps(args) -> dict[str, str]:
    for name, value in ray_serve.RAY_ENV.items():
        os.environ.setdefault(name, value)
    import ray

    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    engine = EngineConfig(model=args.model, num_blocks=args.num_blocks, max_num_seqs=32)
    options = ServerOptions(
        model_name=args.model, shadow_rate=0.0, tenant_secret=secrets.token_bytes(32)
    )
    cpus = args.ray_cpus / (2 * args.replicas)  # both applications' replicas fit at once
    urls = {}
    for policy in ROUTERS:
        spec = ray_serve.ReplicaSpec(engine, options, cpus=cpus)
        config = ray_serve.ServiceConfig(spec, args.replicas, RouterConfig(policy=policy))
        ray_serve.start(config, "127.0.0.1", args.port, app_name=policy, route_prefix=f"/{policy}")
        urls[policy] = f"http://127.0.0.1:{args.port}/{policy}"
    return urls


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--shared-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--ray-cpus", type=int, default=os.cpu_count() or 2)
    p.add_argument("--port", type=int, default=18600)
    args = p.parse_args()
    print(
        f"{args.replicas} replicas of {args.model} per router, {args.clients} clients; multi-turn: "
        f"{args.conversations} conversations x {args.turns} turns; shared-system: "
        f"{args.shared_requests} requests; {args.max_tokens} output tokens; Ray CPUs {args.ray_cpus}"
    )
    urls = start_apps(args)
    workloads = {"multi-turn": multi_turn(args), "shared-system": shared_system(args)}
    header = f"{'workload':<14}{'router':<13}{'reqs':>6}{'hit rate':>10}{'prefill tok':>13}"
    print(header + f"{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'req/s':>8}")
    for workload, jobs in workloads.items():
        for policy in ROUTERS:
            r = run_workload(urls[policy], jobs, args.clients)
            print(
                f"{workload:<14}{policy:<13}{r.requests:>6}{r.cached / r.prompt:>10.3f}"
                f"{r.prompt - r.cached:>13}{1e3 * statistics.median(r.ttfts):>13.1f}"
                f"{1e3 * percentile(r.ttfts, 0.99):>13.1f}{r.requests / r.seconds:>8.2f}",
                flush=True,
            )
    from ray import serve

    serve.shutdown()


if __name__ == "__main__":
    main()
