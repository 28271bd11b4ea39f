"""The Ray Serve request router of the engine deployment: `prefix_router.Router` on live replicas.

Ray creates it in the process that holds the deployment handle (the ingress) and asks it, per
request, for the replicas to try. Load is counted here (requests routed and not yet completed),
so the policy sees every request this ingress has in flight without probing replicas. A call
pinned to a replica (the ingress's fan-out for /metrics) goes only there.

A request for a LoRA adapter goes only to a replica that holds it (`Router.choose` filters by the
replicas' adapter snapshots). The snapshots come from Ray's routing stats (each replica's
`record_routing_stats`, pulled periodically) and from the ingress, which reports the snapshot a
replica returns with its answer to a load or unload at once. When no live replica holds the
adapter the request waits here, as any Ray Serve request waits for a replica, until a snapshot
names a holder; the ingress answers such a request itself before sending it (404 or 503), so
only one whose holders vanished in between waits.

The instance registers itself in `ROUTERS` by (application, deployment), so the ingress, in the same
process, can list the live replicas and read the routing counters."""

from __future__ import annotations

from collections import Counter, OrderedDict

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from kvpage.serve_replicas.adapter_holdings import AdapterNotHeld, Holdings
from kvpage.serve_replicas.asgi_call import HttpCall
from kvpage.serve_replicas.prefix_router import Router, RouterConfig

ROUTERS: dict[tuple[str, str], KVPageRequestRouter] = {}  # (app, deployment) -> router
# Completions heard of before their routing, kept by id (bounded: a rejected request completes
# and is never routed, so its id stays until pushed out).
EARLY_COMPLETIONS_KEPT = 4096


class KVPageRequestRouter(RequestRouter):
    def initialize_state(self, **config) -> None:
        self.router = Router(RouterConfig(**config))
        self.loads: Counter[str] = Counter()  # replica id -> requests in flight
        self._in_flight: dict[str, str] = {}  # internal request id -> replica id
        self._completed_early: OrderedDict[str, None] = OrderedDict()
        self.decisions: Counter[tuple[str, str]] = Counter()  # (replica, reason) -> requests
        self.matched_tokens: Counter[str] = Counter()  # replica -> prompt tokens it had seen
        # Ray may ship this class by value, with copies of its module's globals: reach the real
        # registry through the import system, where the ingress will look for it.
        from kvpage.serve_replicas import ray_router

        ray_router.ROUTERS[self.app_name, self._deployment_id.name] = self

    def replica_ids(self) -> list[str]:
        return sorted(r.unique_id for r in self.curr_replicas)

    def holders(self, adapter: str) -> list[str]:
        """The live replicas that may serve a request for `adapter`."""
        return self.router.eligible(adapter, self.replica_ids())

    def unreported(self) -> list[str]:
        """Live replicas whose adapters the router does not know yet (just started)."""
        return [r for r in self.replica_ids() if r not in self.router.holdings.latest]

    def report(self, replica: str, snapshot: Holdings | None) -> None:
        """A replica's adapter snapshot from the ingress (one of a replica gone since is
        dropped at the next replica update)."""
        self.router.report(replica, snapshot)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        call = _http_call(pending_request)
        if call is not None and call.pin is not None:
            return [[by_id[call.pin]]] if call.pin in by_id else []
        if call is None or not by_id:  # not an HTTP call (none are sent today): any replica
            return [list(by_id.values())]
        try:
            decision = self.router.choose(call.key, {rid: self.loads[rid] for rid in by_id})
        except AdapterNotHeld:  # Ray asks again on its backoff and on each replica update
            return []
        self.decisions[decision.replica, decision.reason] += 1
        self.matched_tokens[decision.replica] += decision.matched_tokens
        return [[by_id[decision.replica]]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        request = pending_request.metadata.internal_request_id
        if request in self._completed_early:  # done already: counted now, it would never end
            del self._completed_early[request]
            return
        self._in_flight[request] = replica_id.unique_id
        self.loads[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Ray registers the completion callback before it awaits the replica's accept and
        calls on_request_routed after: a short request can complete in between."""
        replica = self._in_flight.pop(internal_request_id, None)
        if replica is not None:
            self.loads[replica] -= 1
            return
        self._completed_early[internal_request_id] = None
        while len(self._completed_early) > EARLY_COMPLETIONS_KEPT:
            self._completed_early.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for replica in replicas:  # Ray's routing stats: each replica's record_routing_stats
            self.router.report(replica.replica_id.unique_id, _snapshot(replica))
        known = set(self.router.trees) | set(self.router.holdings.latest)
        for gone in known - live:  # replaced or scaled down: its cache is gone
            self._forget(gone)

    def _forget(self, replica: str) -> None:
        self.router.forget(replica)
        self.loads.pop(replica, None)


def _snapshot(replica: RunningReplica) -> Holdings | None:
    return Holdings.from_stats(getattr(replica, "routing_stats", None))


def _http_call(pending: PendingRequest | None) -> HttpCall | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], HttpCall):
        return None
    return pending.args[0]
