"""The router's in-flight count per replica, in both orders Ray can report a request in: Ray
registers the completion callback before it awaits the replica's accept, and calls
on_request_routed after, so a short request may complete first. Driven through the hooks
directly (no Ray cluster): the order is the point, and a cluster makes it a matter of luck."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from kvpage.serve_replicas import ray_router
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
