"""The routing tree and policy without Ray: exact matches, LRU eviction order, the tenant wall,
each branch of the prefix-affinity decision, and the adapter filter (a request for a LoRA
adapter only to a replica whose latest report lists it)."""

from __future__ import annotations

import pytest

from kvpage.serve_replicas.adapter_holdings import AdapterNotHeld, Holdings
from kvpage.serve_replicas.prefix_router import Router, RouterConfig, RoutingKey
from kvpage.serve_replicas.prefix_tree import PrefixTree


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_match_counts_whole_chunks_only():
    tree = PrefixTree(chunk=4)
    tree.insert("t", _tokens(0, 10))  # two full chunks; the 2-token tail is never shared
    assert tree.match("t", _tokens(0, 10)) == 8
    assert tree.match("t", _tokens(0, 7)) == 4
    assert tree.match("t", [0, 1, 2, 9, 4, 5, 6, 7]) == 0  # differs inside the first chunk
    assert tree.match("t", _tokens(0, 3)) == 0
    assert len(tree) == 3  # namespace root + 2 chunks


def test_namespaces_never_share_entries():
    tree = PrefixTree(chunk=4)
    tree.insert("alice", _tokens(0, 16))
    assert tree.match("alice", _tokens(0, 16)) == 16
    assert tree.match("bob", _tokens(0, 16)) == 0
    assert tree.match("", _tokens(0, 16)) == 0


def test_lru_evicts_oldest_leaf_first_and_keeps_shared_parents():
    tree = PrefixTree(chunk=2, max_nodes=5)
    tree.insert("t", [1, 1, 2, 2])  # root, (1,1), (2,2): 3 nodes
    tree.insert("t", [1, 1, 3, 3])  # + (3,3): 4 nodes
    tree.insert("t", [1, 1, 2, 2])  # touch the first branch again
    tree.insert("t", [1, 1, 4, 4])  # + (4,4): 5 nodes
    tree.insert("t", [1, 1, 5, 5])  # 6 > 5: the least recent leaf (3,3) goes
    assert tree.evictions == 1
    assert tree.match("t", [1, 1, 3, 3]) == 2  # its parent is still there
    assert tree.match("t", [1, 1, 2, 2]) == 4
    assert tree.match("t", [1, 1, 4, 4]) == 4
    assert tree.match("t", [1, 1, 5, 5]) == 4
    assert len(tree) == 5


def test_eviction_reaches_parents_once_their_children_are_gone():
    tree = PrefixTree(chunk=1, max_nodes=3)
    tree.insert("a", [1, 2])  # a, 1, 2
    tree.insert("b", [7])  # b, 7 -> evicts 2 then 1 (oldest leaves, deepest first)
    assert tree.match("a", [1, 2]) == 0
    assert tree.match("b", [7]) == 1
    assert len(tree) == 3


def _router(**kw) -> Router:
    return Router(RouterConfig(chunk_tokens=4, min_match_tokens=4, **kw))


def test_follow_up_turn_goes_to_the_replica_that_has_the_history():
    router = _router()
    loads = {"r0": 0, "r1": 0}
    first = router.choose(RoutingKey("t", tuple(_tokens(0, 20))), loads)
    assert first.reason == "least-loaded"
    other = router.choose(RoutingKey("t", tuple(_tokens(100, 20))), loads)
    assert other.replica != first.replica  # fewest tree nodes breaks the tie: spread out
    follow = router.choose(RoutingKey("t", tuple(_tokens(0, 32))), loads)
    assert (follow.replica, follow.reason, follow.matched_tokens) == (first.replica, "prefix", 20)


def test_other_tenant_with_the_same_tokens_gets_no_affinity():
    router = _router()
    loads = {"r0": 0, "r1": 0}
    router.choose(RoutingKey("alice", tuple(_tokens(0, 32))), loads)
    bob = router.choose(RoutingKey("bob", tuple(_tokens(0, 32))), loads)
    assert (bob.reason, bob.matched_tokens) == ("least-loaded", 0)


def test_imbalance_bound_overrides_affinity():
    router = _router(max_imbalance=2)
    key = RoutingKey("t", tuple(_tokens(0, 32)))
    home = router.choose(key, {"r0": 0, "r1": 0}).replica
    away = "r1" if home == "r0" else "r0"
    assert router.choose(key, {home: 2, away: 0}).reason == "prefix"  # within the bound
    over = router.choose(key, {home: 3, away: 0})
    assert (over.replica, over.reason) == (away, "imbalance")


def test_short_or_small_fraction_matches_do_not_steer():
    router = _router(min_match_fraction=0.5)
    loads = {"r0": 0, "r1": 0}
    home = router.choose(RoutingKey("t", tuple(_tokens(0, 8))), loads).replica
    away = "r1" if home == "r0" else "r0"
    long_prompt = RoutingKey("t", tuple(_tokens(0, 8)) + tuple(_tokens(500, 40)))
    decision = router.choose(long_prompt, {home: 1, away: 0})  # 8 of 48 tokens < 50%
    assert (decision.replica, decision.reason) == (away, "least-loaded")


def test_round_robin_and_least_loaded_ignore_prefixes():
    rr = _router(policy="round-robin")
    key = RoutingKey("t", tuple(_tokens(0, 32)))
    picks = [rr.choose(key, {"r0": 0, "r1": 0}).replica for _ in range(4)]
    assert picks == ["r0", "r1", "r0", "r1"]
    ll = _router(policy="least-loaded")
    assert ll.choose(key, {"r0": 5, "r1": 1}).replica == "r1"


def test_a_dead_replica_is_forgotten():
    router = _router()
    key = RoutingKey("t", tuple(_tokens(0, 32)))
    home = router.choose(key, {"r0": 0, "r1": 0}).replica
    router.forget(home)
    survivor = "r1" if home == "r0" else "r0"
    decision = router.choose(key, {survivor: 0})
    assert (decision.replica, decision.reason) == (survivor, "least-loaded")


@pytest.mark.parametrize(
    "kw",
    [{"policy": "random"}, {"chunk_tokens": 0}, {"min_match_fraction": 1.5}, {"max_imbalance": -1}],
)
def test_bad_config_is_refused(kw):
    with pytest.raises(ValueError):
        RouterConfig(**kw)


def test_no_replicas_is_an_error():
    with pytest.raises(ValueError, match="no replica"):
        _router().choose(RoutingKey("t", ()), {})


# --- the adapter filter --------------------------------------------------------------------
def _held(seq: int, *adapters: str) -> Holdings:
    return Holdings(seq, frozenset(adapters))


@pytest.mark.parametrize("policy", ["prefix", "round-robin", "least-loaded"])
def test_a_request_for_an_adapter_goes_only_to_a_replica_that_holds_it(policy):
    router = Router(RouterConfig(policy=policy, chunk_tokens=4, min_match_tokens=4))
    router.report("r0", _held(1, "sql"))
    router.report("r1", _held(1))  # holds no adapter
    # r2 has not reported (just started): it holds nothing as far as the router knows
    loads = {"r0": 9, "r1": 0, "r2": 0}  # the holder is by far the busiest
    for i in range(6):
        key = RoutingKey("t|adapter:3:sql", tuple(_tokens(i, 8)), "sql")
        assert router.choose(key, loads).replica == "r0"
    base = {router.choose(RoutingKey("t", tuple(_tokens(i, 8))), loads).replica for i in range(6)}
    assert base != {"r0"}  # the base model is not held back by the filter
    with pytest.raises(AdapterNotHeld, match="'chat'"):
        router.choose(RoutingKey("t|adapter:4:chat", (1, 2), "chat"), loads)


def test_a_stale_adapter_report_never_undoes_a_newer_one():
    router = Router(RouterConfig())
    assert router.report("r0", _held(2, "sql"))
    assert not router.report("r0", _held(1))  # sent before the load, arrived after it
    assert router.eligible("sql", ["r0"]) == ["r0"]
    assert router.report("r0", _held(3))  # unloaded since
    assert router.eligible("sql", ["r0"]) == []
    router.report("r1", _held(1, "sql"))
    router.forget("r1")  # a dead replica's adapters died with it
    assert router.eligible("sql", ["r0", "r1"]) == []


def test_an_adapter_filter_that_trusts_unreported_replicas_is_caught_by_this_test():
    """The mutant of the stack gate, here by hand: it would send the request to r1."""
    from kvpage.verify.stack.mutants import STACK_MUTANTS

    mutant = next(m for m in STACK_MUTANTS if m.expected_class == "router_adapter")
    router = Router(RouterConfig(policy="least-loaded"))
    mutant.apply(router)
    router.report("r0", _held(1, "sql"))
    chosen = router.choose(RoutingKey("t", (1,), "sql"), {"r0": 3, "r1": 0}).replica
    assert chosen == "r1"  # the bug shows: r1 never said it holds "sql"


def test_holdings_travel_as_routing_stats():
    snapshot = Holdings(4, frozenset({"a", "b"}), (("c", "no such directory"),))
    assert Holdings.from_stats(snapshot.to_stats()) == snapshot
    assert Holdings.from_stats({}) is None  # Ray's stats before the first pull
