"""The router's in-flight count per replica, in both orders Ray can report a request in: Ray
registers the completion callback before it awaits the replica's accept, and calls
on_request_routed after, so a short request may complete first. Driven through the hooks
directly (no Ray cluster): the order is the point, and a cluster makes it a matter of luck. And
the adapter holdings the router takes from Ray's routing stats, and a request for an adapter no
live replica holds, which waits rather than going to one without it."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

from ray.serve.request_router import RequestRouter

from kvpage.serve_replicas import ray_router
from kvpage.serve_replicas.adapter_holdings import Holdings
from kvpage.serve_replicas.asgi_call import HttpCall
from kvpage.serve_replicas.prefix_router import Router, RouterConfig, RoutingKey
from kvpage.serve_replicas.ray_router import KVPageRequestRouter


def _router() -> KVPageRequestRouter:
    router = object.__new__(KVPageRequestRouter)  # Ray's constructor needs a running controller
    router.loads, router._in_flight = Counter(), {}
    router._completed_early = ray_router.OrderedDict()
    return router


def _pending(request: str):
    return SimpleNamespace(metadata=SimpleNamespace(internal_request_id=request))


def _replica(name: str):
    return SimpleNamespace(unique_id=name)


def test_routed_then_completed_ends_at_zero():
    router = _router()
    router.on_request_routed(_pending("r1"), _replica("a"), None)
    assert router.loads["a"] == 1
    router.on_request_completed(_replica("a"), "r1")
    assert router.loads["a"] == 0


def test_completed_before_routed_is_never_left_in_flight():
    router = _router()
    router.on_request_completed(_replica("a"), "r1")
    router.on_request_routed(_pending("r1"), _replica("a"), None)
    router.on_request_routed(_pending("r2"), _replica("a"), None)
    assert router.loads["a"] == 1 and set(router._in_flight) == {"r2"}
    router.on_request_completed(_replica("a"), "r2")
    assert router.loads["a"] == 0 and not router._completed_early


def test_completions_never_routed_are_kept_bounded():
    router = _router()
    for i in range(ray_router.EARLY_COMPLETIONS_KEPT + 10):  # rejected requests: never routed
        router.on_request_completed(_replica("a"), f"r{i}")
    assert len(router._completed_early) == ray_router.EARLY_COMPLETIONS_KEPT
    assert router.loads["a"] == 0


# --- adapter holdings ----------------------------------------------------------------------
def _running(name: str, stats: dict):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats=stats)


def _adapter_router(monkeypatch) -> KVPageRequestRouter:
    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)
    router = _router()
    router.router = Router(RouterConfig(policy="least-loaded"))
    router.decisions, router.matched_tokens = Counter(), Counter()
    return router


def test_routing_stats_tell_the_router_what_each_replica_holds(monkeypatch):
    router = _adapter_router(monkeypatch)
    held = Holdings(2, frozenset({"sql"})).to_stats()
    router.update_replicas([_running("a", held), _running("b", {})])  # b: not pulled yet
    assert router.router.eligible("sql", ["a", "b"]) == ["a"]
    router.update_replicas([_running("a", Holdings(1).to_stats())])  # stale: a still holds it
    assert router.router.eligible("sql", ["a"]) == ["a"]
    router.update_replicas([_running("b", Holdings(1, frozenset({"sql"})).to_stats())])
    assert set(router.router.holdings.latest) == {"b"}  # a is gone, and its holdings with it


def test_a_request_no_live_replica_holds_waits_instead_of_going_anywhere(monkeypatch):
    router = _adapter_router(monkeypatch)
    router.update_replicas([_running("a", Holdings(1).to_stats())])
    replica = SimpleNamespace(replica_id=SimpleNamespace(unique_id="a"))

    def pending(adapter: str):
        call = HttpCall("POST", "/v1/completions", b"", [], b"", RoutingKey("t", (1,), adapter))
        return SimpleNamespace(args=[call])

    assert asyncio.run(router.choose_replicas([replica], pending("sql"))) == []
    assert asyncio.run(router.choose_replicas([replica], pending(""))) == [[replica]]
