"""A brute-force model of the replica router's policy (kvpage.serve_replicas.prefix_router), and
the router suite that drives the real policy object with generated request sequences and
compares every decision and every replica's tree size with the model's.

The model is written from the policy's documentation, not its code: per replica, a flat dict of
every prefix it holds — (namespace,) for a namespace root, (namespace, chunk 1, ..., chunk i)
for the prompt's first i whole chunks — each with the time it was last sent. A match is the
longest run of such prefixes; the bound evicts the least recently used entry, a path's deeper
entries counting as older than its shallower ones at the same time (so a parent always
outlives its children). No tree, no ordered dict, no incremental state but the timestamps.

LoRA adapters, from the router's documentation too: each replica's latest report of the adapters
it holds (a report with a sequence number no higher than the kept one is stale and changes
nothing; a forgotten replica's report goes with it). A request for the base model may go to any
live replica; one for an adapter only to a live replica whose kept report lists it, the policy
choosing among those alone; with none, no replica at all (the router raises AdapterNotHeld and
records nothing). A disagreement where the router's choice lacks the adapter (or where one side
found no holder and the other did) is attributed `router_adapter`, any other `router_policy`."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvpage.serve_replicas.adapter_holdings import AdapterNotHeld, Holdings
from kvpage.serve_replicas.prefix_router import Router, RouterConfig, RoutingKey
from kvpage.verify.checks import Failure, finding
from kvpage.verify.suites import CaseResult

Prefix = tuple  # (namespace, chunk, chunk, ...)


@dataclass(slots=True)
class ModelReplica:
    chunk: int
    max_nodes: int
    last_used: dict[Prefix, tuple[int, int]] = field(default_factory=dict)  # (time, -depth)

    def prefixes(self, namespace: str, tokens: tuple[int, ...]) -> list[Prefix]:
        whole = len(tokens) // self.chunk
        chunks = [tokens[i * self.chunk : (i + 1) * self.chunk] for i in range(whole)]
        return [(namespace, *chunks[:i]) for i in range(whole + 1)]

    def match(self, namespace: str, tokens: tuple[int, ...]) -> int:
        held = 0
        for depth, prefix in enumerate(self.prefixes(namespace, tokens)):
            if prefix not in self.last_used:
                break
            held = depth
        return held * self.chunk if (namespace,) in self.last_used else 0

    def insert(self, namespace: str, tokens: tuple[int, ...], now: int) -> None:
        for depth, prefix in enumerate(self.prefixes(namespace, tokens)):
            self.last_used[prefix] = (now, -depth)
        while len(self.last_used) > self.max_nodes:
            del self.last_used[min(self.last_used, key=self.last_used.__getitem__)]


NO_HOLDER = ("", "no holder", 0)  # the decision when no live replica holds the adapter


@dataclass(slots=True)
class RouterModel:
    config: RouterConfig
    replicas: dict[str, ModelReplica] = field(default_factory=dict)
    reports: dict[str, tuple[int, frozenset[str]]] = field(default_factory=dict)  # (seq, held)
    round_robin: int = 0
    clock: int = 0

    def choose(self, key: RoutingKey, loads: Mapping[str, int]) -> tuple[str, str, int]:
        names = sorted(loads)
        for name in names:
            self.replicas.setdefault(
                name, ModelReplica(self.config.chunk_tokens, self.config.max_nodes_per_replica)
            )
        names = self.holding(key.adapter, names)
        if not names:
            return NO_HOLDER
        replica, reason, matched = self._decide(key, names, loads)
        self.clock += 1
        self.replicas[replica].insert(key.namespace, key.tokens, self.clock)
        return replica, reason, matched

    def holding(self, adapter: str, names: list[str]) -> list[str]:
        """The replicas among `names` a request for `adapter` may go to."""
        if not adapter:
            return names
        return [n for n in names if n in self.reports and adapter in self.reports[n][1]]

    def report(self, replica: str, seq: int, adapters: frozenset[str]) -> None:
        if replica not in self.reports or self.reports[replica][0] < seq:
            self.reports[replica] = (seq, adapters)

    def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)
        self.reports.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self.replicas[replica].last_used) if replica in self.replicas else 0

    def _decide(self, key: RoutingKey, names: list[str], loads) -> tuple[str, str, int]:
        cfg = self.config
        if cfg.policy == "round-robin":
            self.round_robin += 1
            return names[(self.round_robin - 1) % len(names)], "round-robin", 0
        least = min(names, key=lambda r: (loads[r], self.size(r), r))
        if cfg.policy == "least-loaded":
            return least, "least-loaded", 0
        matches = {r: self.replicas[r].match(key.namespace, key.tokens) for r in names}
        best = max(matches.values())
        worth = best >= max(cfg.min_match_tokens, 1) and best >= cfg.min_match_fraction * len(
            key.tokens
        )
        if not worth:
            return least, "least-loaded", matches[least]
        target = min((r for r in names if matches[r] == best), key=lambda r: (loads[r], r))
        if loads[target] - loads[least] > cfg.max_imbalance:
            return least, "imbalance", matches[least]
        return target, "prefix", best


# --- generated sequences -------------------------------------------------------------------------
NAMESPACES = ("tenant:alice", "tenant:bob", "salt:s1", "open")


ADAPTERS = ("sql", "chat")


@dataclass(frozen=True, slots=True)
class RouteEvent:
    key: RoutingKey | None  # None: forget `replica`, or (with `report`) its adapter report
    loads: dict[str, int]
    replica: str = ""
    report: Holdings | None = None


def make_sequence(rng: random.Random, length: int) -> tuple[RouterConfig, list[RouteEvent]]:
    chunk = rng.choice((2, 4))
    config = RouterConfig(
        policy=rng.choice(("prefix", "prefix", "prefix", "round-robin", "least-loaded")),
        chunk_tokens=chunk,
        min_match_tokens=rng.choice((0, chunk, 2 * chunk)),
        min_match_fraction=rng.choice((0.0, 0.1, 0.5)),
        max_imbalance=rng.choice((0, 1, 3)),
        max_nodes_per_replica=rng.randint(3, 14),
    )
    replicas = [f"replica-{i}" for i in range(rng.randint(2, 4))]
    seqs = dict.fromkeys(replicas, 0)
    talks: list[tuple[str, tuple[int, ...]]] = []
    events = []
    for _ in range(length):
        roll = rng.random()
        if roll < 0.04:
            events.append(RouteEvent(None, {}, rng.choice(replicas)))
            continue
        if roll < 0.16:
            events.append(_report(rng, rng.choice(replicas), seqs))
            continue
        live = [r for r in replicas if rng.random() < 0.9] or replicas[:1]
        loads = {r: rng.randint(0, 4) for r in live}
        namespace, tokens = _conversation(rng, talks, chunk)
        adapter = rng.choice(ADAPTERS) if rng.random() < 0.3 else ""
        if adapter:  # as the ingress keys it: the adapter's prefixes are its own
            namespace += f"|adapter:{len(adapter)}:{adapter}"
        events.append(RouteEvent(RoutingKey(namespace, tokens, adapter), loads))
    return config, events


def _report(rng: random.Random, replica: str, seqs: dict[str, int]) -> RouteEvent:
    """A replica's adapter report: mostly a newer one, sometimes one that arrives late (a
    lower sequence number than one already sent)."""
    if seqs[replica] and rng.random() < 0.25:
        seq = rng.randint(1, seqs[replica])  # stale: crossed a newer one on the way
    else:
        seqs[replica] += 1
        seq = seqs[replica]
    held = frozenset(a for a in ADAPTERS if rng.random() < 0.6)
    return RouteEvent(None, {}, replica, Holdings(seq, held))


def _conversation(rng: random.Random, talks: list, chunk: int) -> tuple[str, tuple[int, ...]]:
    """A new conversation, the next turn of one, or the same tokens under another namespace
    (which must never match)."""
    roll = rng.random()
    if talks and roll < 0.55:
        i = rng.randrange(len(talks))
        ns, tokens = talks[i]
        tokens = tokens + tuple(rng.randrange(50) for _ in range(rng.randint(0, 2 * chunk)))
        talks[i] = (ns, tokens)
        return ns, tokens
    if talks and roll < 0.75:
        ns, tokens = rng.choice(talks)
        other = rng.choice([n for n in NAMESPACES if n != ns])
        return other, tokens
    tokens = tuple(rng.randrange(50) for _ in range(rng.randint(1, 5 * chunk)))
    talks.append((rng.choice(NAMESPACES), tokens))
    return talks[-1]


# --- the suite -----------------------------------------------------------------------------------
SEQUENCES = 12
EVENTS_PER_SEQUENCE = 60


def router_cases(seed: int, plant: Callable[[Router], None] | None = None) -> list[CaseResult]:
    """One case per generated sequence. `plant(router)`: a router mutant."""
    rng = random.Random(seed ^ 0x5EED)
    results = []
    for i in range(SEQUENCES):
        config, events = make_sequence(rng, EVENTS_PER_SEQUENCE)
        start = time.perf_counter()
        router = Router(config)
        if plant is not None:
            plant(router)
        failures = _replay(router, RouterModel(config), events, f"router-{i}")
        seconds = time.perf_counter() - start
        stats = {"policy": config.policy, "max_nodes": config.max_nodes_per_replica}
        results.append(
            CaseResult(f"router-{i}", "router", failures, len(events), len(events), seconds, stats)
        )
    return results


def _replay(router: Router, model: RouterModel, events: list[RouteEvent], name: str):
    """The first disagreement of the sequence (later ones follow from it)."""
    for step, event in enumerate(events):
        if event.report is not None:
            router.report(event.replica, event.report)
            model.report(event.replica, event.report.seq, event.report.adapters)
            continue
        if event.key is None:
            router.forget(event.replica)
            model.forget(event.replica)
            continue
        want = model.choose(event.key, event.loads)
        try:
            decision = router.choose(event.key, event.loads)
            have = (decision.replica, decision.reason, decision.matched_tokens)
        except AdapterNotHeld:
            have = NO_HOLDER
        except Exception as err:  # a policy that breaks its own invariant is caught too
            return [_failure(name, step, event, "decision", want, f"raised {err!r}")]
        if have != want:
            holders = model.holding(event.key.adapter, sorted(event.loads))
            return [_failure(name, step, event, "decision", want, have, holders)]
        sizes = {r: len(t) for r, t in sorted(router.trees.items())}
        model_sizes = {r: model.size(r) for r in sizes}
        if sizes != model_sizes:
            return [_failure(name, step, event, "tree sizes", model_sizes, sizes)]
    return []


def _failure(
    name: str, step: int, event: RouteEvent, what: str, want, have, holders=None
) -> Failure:
    fields = {
        "event": step,
        "field": what,
        "expected": want,
        "actual": have,
        "namespace": event.key.namespace,
        "loads": dict(event.loads),
    }
    if _adapter_breach(event.key.adapter, want, have, holders):
        fields.update(adapter=event.key.adapter, holders=list(holders))
        reason = f"request for adapter {event.key.adapter!r} routed to a replica without it"
        if have == NO_HOLDER:
            reason = f"no replica found for adapter {event.key.adapter!r}, though {holders} hold it"
        div = finding("router", "router_adapter", reason, fields, name, step)
        return Failure("router", f"{name} event {step}: {reason}", name, div)
    reason = f"{what} differs from the brute-force model of the policy"
    div = finding("router", "router_policy", reason, fields, name, step)
    return Failure("router", f"{name} event {step}: {reason}", name, div)


def _adapter_breach(adapter: str, want, have, holders) -> bool:
    """The router's answer breaks the adapter rule itself: it chose a replica that does not
    hold the request's adapter, or found no holder where the model found one."""
    if not adapter or holders is None or not isinstance(have, tuple):
        return False
    return have[0] not in holders or (have == NO_HOLDER) != (want == NO_HOLDER)
