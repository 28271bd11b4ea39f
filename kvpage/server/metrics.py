"""Prometheus metrics on a per-app registry (tests build several apps in one process).

Engine counters are monotonic totals kept by the engine; they are read once per scrape on the engine
thread (`engine_snapshot`, which is `engine.stats()`) and exposed by a collector, so no number is counted twice. Latencies are
observed by the server as tokens reach clients, the restore latency from the engine's swap-in
events (ServerMetrics is an engine observer), and pollution by the shadow comparison."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvpage.engine.engine import LLMEngine
from kvpage.engine.events import EngineEvent, EngineObserver, SwappedIn

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BLOCK_STATES = ("free", "private", "shared", "cached", "evicting", "restoring")
COUNTERS = {  # engine stats key -> (metric name without _total, help)
    "prefix_queries": (
        "kvpage_prefix_cache_queries_tokens",
        "Prompt tokens looked up in the cache",
    ),
    "prefix_hits": ("kvpage_prefix_cache_hits_tokens", "Prompt tokens served by the prefix cache"),
    "block_allocations": ("kvpage_kv_block_allocations", "KV blocks taken from the free list"),
    "block_frees": ("kvpage_kv_block_frees", "KV blocks returned to the free list"),
    "generation_bumps": ("kvpage_kv_block_generation_bumps", "Block generation bumps"),
    "cow_copies": ("kvpage_kv_cow_copies", "Copy-on-write block copies"),
    "evictions": ("kvpage_kv_block_evictions", "Cached blocks evicted"),
    "corruptions": ("kvpage_cache_corruptions", "Fast-key hits whose full digest differed"),
    "key_collisions": (
        "kvpage_cache_key_collisions",
        "Publishes refused: the fast key is held by another digest",
    ),
    "aborts": ("kvpage_request_aborts", "Requests aborted (client gone, stop string)"),
}
# vLLM's spec_decode_* counters, present (as in vLLM) only when the engine speculates
SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": (
        "kvpage_spec_decode_num_drafts",
        "Speculative verifications (one per speculating sequence and step)",
    ),
    "spec_decode_num_draft_tokens": (
        "kvpage_spec_decode_num_draft_tokens",
        "Draft tokens proposed",
    ),
    "spec_decode_num_accepted_tokens": (
        "kvpage_spec_decode_num_accepted_tokens",
        "Draft tokens the target accepted",
    ),
}
ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_pos_"  # + draft position 0..k-1


def engine_snapshot(engine: LLMEngine) -> dict[str, int]:
    """The engine's stats; call it on the engine thread."""
    return engine.stats()


class _EngineCollector:
    """Exposes the last engine snapshot, handed over (`show`) right before each scrape."""

    def __init__(self, shadow_counts: Callable[[], tuple[int, int]]) -> None:
        self.stats: dict[str, int] = {}
        self.shadow_counts = shadow_counts  # () -> (checked, mismatched)

    def show(self, stats: dict[str, int]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if not s:
            return
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=s[key])
        yield _gauge(
            "kvpage_prefix_cache_hit_ratio", "Lifetime hits / queries (tokens)", _hit_ratio(s)
        )
        blocks = GaugeMetricFamily("kvpage_kv_blocks", "KV blocks by state", labels=["state"])
        for state in BLOCK_STATES:
            blocks.add_metric([state], s[f"{state}_blocks"])
        yield blocks
        pre = CounterMetricFamily("kvpage_preemptions", "Preemptions by mode", labels=["mode"])
        for mode in ("recompute", "swap"):
            pre.add_metric([mode], s[f"preemptions_{mode}"])
        yield pre
        reqs = GaugeMetricFamily("kvpage_requests", "Requests by queue", labels=["queue"])
        for q in ("running", "waiting", "swapped"):
            reqs.add_metric([q], s[q])
        yield reqs
        if "spec_decode_num_drafts" in s:
            yield from _spec_decode(s)
        checked, bad = self.shadow_counts()
        yield CounterMetricFamily("kvpage_shadow_checks", "Shadow comparisons run", value=checked)
        yield CounterMetricFamily(
            "kvpage_shadow_mismatches", "Shadow comparisons that differed", value=bad
        )
        yield _gauge(
            "kvpage_pollution_ratio", "Lifetime shadow mismatches / checks", bad / max(checked, 1)
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _hit_ratio(s: dict[str, Any]) -> float:
    return s["prefix_hits"] / s["prefix_queries"] if s["prefix_queries"] else 0.0


def _spec_decode(s: dict[str, Any]) -> Iterator[Metric]:
    """vLLM's spec_decode counters, and two lifetime figures derived from them: the share of
    draft tokens accepted, and vLLM's mean acceptance length (tokens per verification, the
    target's own token included)."""
    for key, (name, doc) in SPEC_DECODE_COUNTERS.items():
        yield CounterMetricFamily(name, doc, value=s[key])
    per_pos = CounterMetricFamily(
        "kvpage_spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft",
        labels=["position"],
    )
    positions = sorted(int(k[len(ACCEPTED_PER_POS) :]) for k in s if k.startswith(ACCEPTED_PER_POS))
    for pos in positions:
        per_pos.add_metric([str(pos)], s[f"{ACCEPTED_PER_POS}{pos}"])
    yield per_pos
    drafted, accepted = s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]
    drafts = s["spec_decode_num_drafts"]
    yield _gauge(
        "kvpage_spec_decode_acceptance_ratio",
        "Lifetime draft tokens accepted / proposed",
        accepted / drafted if drafted else 0.0,
    )
    yield _gauge(
        "kvpage_spec_decode_mean_acceptance_length",
        "Lifetime tokens per verification: 1 + accepted draft tokens / verifications",
        1 + accepted / drafts if drafts else 0.0,
    )


class ServerMetrics(EngineObserver):
    """The app's metrics; attached to the engine as an observer for the restore latency."""

    def __init__(self, shadow_counts: Callable[[], tuple[int, int]]) -> None:
        self.registry = CollectorRegistry()
        # Every metric lives in this app's registry; latencies share their buckets.
        latency = partial(Histogram, registry=self.registry, buckets=LATENCY_BUCKETS)
        counter = partial(Counter, registry=self.registry)
        self.ttft = latency("kvpage_time_to_first_token_seconds", "Arrival to first token")
        self.itl = latency(
            "kvpage_inter_token_latency_seconds", "Between consecutive tokens of a request"
        )
        self.e2e = latency(
            "kvpage_e2e_request_latency_seconds",
            "Arrival to the last token of a request that completed",
            buckets=LATENCY_BUCKETS + (60, 120, 300),
        )
        self.prompt_tokens = counter("kvpage_prompt_tokens", "Prompt tokens of requests admitted")
        self.generation_tokens = counter(
            "kvpage_generation_tokens", "Tokens generated and sent to clients"
        )
        self.adapter_requests = counter(
            "kvpage_lora_requests", "Requests admitted, by LoRA adapter", ["adapter"]
        )
        self.adapter_tokens = counter(
            "kvpage_lora_generation_tokens",
            "Tokens generated and sent to clients, by LoRA adapter",
            ["adapter"],
        )
        self.restore_latency = latency(
            "kvpage_restore_latency_seconds", "Swap-in of a preempted request"
        )
        self.requests = counter(
            "kvpage_http_requests",
            "Requests by path and final status (499: the client went away first)",
            ["path", "status"],
        )
        self._collector = _EngineCollector(shadow_counts)
        self.registry.register(self._collector)

    def on_event(self, event: EngineEvent) -> None:
        if isinstance(event, SwappedIn):
            self.restore_latency.observe(event.latency_s)

    def render(self, stats: dict[str, int]) -> bytes:
        self._collector.show(stats)
        return generate_latest(self.registry)
