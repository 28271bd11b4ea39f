"""Which replica serves a request: prefix affinity, round-robin or least-loaded.

Pure Python, no Ray: `kvpage.serve_replicas.ray_router` feeds it the live replicas and their loads
(requests in flight, counted by the router itself) and sends the request where it says.

Prefix affinity, per request with key (namespace, prompt tokens):
  1. each replica's PrefixTree gives the tokens of the longest prefix it was already sent under
     that namespace (namespace first: a tenant never matches another tenant's entry);
  2. if the best match covers at least `min_match_tokens` and `min_match_fraction` of the prompt,
     the best-matching replica (the least loaded among equals) is chosen, unless its load exceeds
     the least-loaded replica's by more than `max_imbalance` requests: then the cache is not
     worth the queue, and the least-loaded replica is chosen;
  3. otherwise the least-loaded replica (fewest tree nodes among equals, so new conversations
     spread out) is chosen.
The prompt is then recorded in the chosen replica's tree, so the next turn of that conversation
follows it there.

Before any policy, a request for a LoRA adapter is narrowed to the replicas that hold it
(`adapter_holdings.holders` over the snapshots in `Router.holdings`); none is `AdapterNotHeld`.
The policy then chooses among those alone, so no rule (round-robin's turn, the imbalance
fallback) can send it to a replica without the adapter.

`Router.tree_factory` and `Router.holders` are declared seams: a verifier's mutant may replace
one on one router to plant a bug in the trees it builds (through their public methods) or in
the adapter filter."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpage.serve_replicas.adapter_holdings import (
    BASE,
    AdapterNotHeld,
    Holdings,
    HoldingsTable,
)
from kvpage.serve_replicas.adapter_holdings import holders as holders_of
from kvpage.serve_replicas.prefix_tree import PrefixTree

ROUTERS = ("prefix", "round-robin", "least-loaded")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: str = "prefix"  # one of ROUTERS
    chunk_tokens: int = 16  # tree granularity: the engine's block size (only full blocks hit)
    min_match_tokens: int = 16  # a shorter match is not worth steering for
    min_match_fraction: float = 0.1  # ... nor one covering less of the prompt than this
    max_imbalance: int = 4  # in-flight requests a match may cost over the least-loaded replica
    max_nodes_per_replica: int = 100_000  # tree bound per replica (LRU leaves go first)

    def __post_init__(self) -> None:
        if self.policy not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.policy!r}")
        if self.chunk_tokens < 1 or self.min_match_tokens < 0 or self.max_imbalance < 0:
            raise ValueError("chunk_tokens >= 1, min_match_tokens >= 0, max_imbalance >= 0")
        if not 0.0 <= self.min_match_fraction <= 1.0:
            raise ValueError(f"min_match_fraction must be in [0, 1], got {self.min_match_fraction}")
        if self.max_nodes_per_replica < 1:
            raise ValueError("max_nodes_per_replica must be >= 1")


@dataclass(frozen=True, slots=True)
class RoutingKey:
    namespace: str  # the tenant (or the open server's cache salt): never shared across tenants
    tokens: tuple[int, ...]  # the prompt as the engine will see it
    adapter: str = BASE  # the LoRA adapter the request names ("" for the base model)


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    reason: str  # "prefix" | "imbalance" | "least-loaded" | "round-robin"
    matched_tokens: int = 0  # of the chosen replica's tree, before this request


@dataclass(slots=True)
class Router:
    """Routing state for one deployment: a tree per replica, the round-robin cursor."""

    config: RouterConfig = field(default_factory=RouterConfig)
    trees: dict[str, PrefixTree] = field(default_factory=dict)
    # (chunk_tokens, max_nodes) -> a replica's tree; a declared seam
    tree_factory: Callable[[int, int], PrefixTree] = PrefixTree
    holdings: HoldingsTable = field(default_factory=HoldingsTable)
    # (adapter, replicas, replica -> latest snapshot) -> those that may serve it; a declared seam
    holders: Callable[[str, Sequence[str], Mapping[str, Holdings]], list[str]] = holders_of
    _turn: itertools.count = field(default_factory=itertools.count)

    def choose(self, key: RoutingKey, loads: Mapping[str, int]) -> Decision:
        """`loads`: replica -> requests in flight, for every live replica. Raises
        AdapterNotHeld when none of them holds the request's adapter."""
        if not loads:
            raise ValueError("no replica to route to")
        self._sync(sorted(loads))
        replicas = self.eligible(key.adapter, sorted(loads))
        if not replicas:
            raise AdapterNotHeld(key.adapter)
        if self.config.policy == "round-robin":
            decision = Decision(replicas[next(self._turn) % len(replicas)], "round-robin")
        elif self.config.policy == "least-loaded":
            decision = Decision(self._least_loaded(replicas, loads), "least-loaded")
        else:
            decision = self._by_prefix(key, replicas, loads)
        self.trees[decision.replica].insert(key.namespace, key.tokens)
        return decision

    def eligible(self, adapter: str, replicas: Sequence[str]) -> list[str]:
        """The replicas among `replicas` that may serve a request for `adapter`."""
        return self.holders(adapter, replicas, self.holdings.latest)

    def report(self, replica: str, snapshot: Holdings | None) -> bool:
        """A replica's adapter snapshot (ignored if an as-new one is kept); True if kept."""
        return self.holdings.note(replica, snapshot)

    def forget(self, replica: str) -> None:
        """A replica died: its cache and its adapters died with it."""
        self.trees.pop(replica, None)
        self.holdings.forget(replica)

    def _sync(self, replicas: Sequence[str]) -> None:
        for name in replicas:
            if name not in self.trees:
                cfg = self.config
                self.trees[name] = self.tree_factory(cfg.chunk_tokens, cfg.max_nodes_per_replica)

    def _by_prefix(
        self, key: RoutingKey, replicas: list[str], loads: Mapping[str, int]
    ) -> Decision:
        matches = {r: self.trees[r].match(key.namespace, key.tokens) for r in replicas}
        best = max(matches.values())
        least = self._least_loaded(replicas, loads)
        if not self._worth_it(best, len(key.tokens)):
            return Decision(least, "least-loaded", matches[least])
        target = min((r for r in replicas if matches[r] == best), key=lambda r: loads[r])
        if loads[target] - loads[least] > self.config.max_imbalance:
            return Decision(least, "imbalance", matches[least])
        return Decision(target, "prefix", best)

    def _worth_it(self, matched: int, prompt_tokens: int) -> bool:
        cfg = self.config
        enough = matched >= max(cfg.min_match_tokens, 1)
        return enough and matched >= cfg.min_match_fraction * prompt_tokens

    def _least_loaded(self, replicas: list[str], loads: Mapping[str, int]) -> str:
        return min(replicas, key=lambda r: (loads[r], len(self.trees[r]), r))
