"""Which LoRA adapters each replica holds, and which replicas may serve a request for one.

A replica reports its holdings as a snapshot taken on its engine thread: the adapter names the
engine has registered, the loads that failed at its start (name -> why), and a sequence number
that grows with every snapshot the replica takes. Snapshots reach the router by two ways that
can cross (the ingress's reply to a load or unload, and Ray's periodic routing stats): the
higher sequence number wins, so an older snapshot never undoes a newer one.

The rule the router applies (`holders`, a declared seam of `prefix_router.Router`): a request
for the base model may go to any replica; a request for an adapter only to a replica whose
latest snapshot lists it. A replica that has not reported yet (just started: Ray replaced a
dead one) holds nothing as far as the router knows, so it gets base-model requests only until
its first snapshot arrives. No holder at all is `AdapterNotHeld`, never a random replica."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpage.errors import KVPageError

BASE = ""  # a routing key's adapter for the base model


class AdapterNotHeld(KVPageError, LookupError):
    """No live replica holds the adapter a request names."""

    def __init__(self, adapter: str) -> None:
        super().__init__(f"no live replica holds adapter {adapter!r}")
        self.adapter = adapter


@dataclass(frozen=True, slots=True)
class Holdings:
    seq: int  # the replica's snapshot counter: a higher one is newer
    adapters: frozenset[str] = frozenset()
    failed: tuple[tuple[str, str], ...] = ()  # (adapter, why) of loads that failed at start

    def to_stats(self) -> dict:
        """As Ray's routing stats carry it (plain data)."""
        return {"seq": self.seq, "adapters": sorted(self.adapters), "failed": list(self.failed)}

    @classmethod
    def from_stats(cls, stats: Mapping | None) -> Holdings | None:
        """None for a replica that has not reported (Ray gives `{}` before the first pull)."""
        if not stats or "seq" not in stats:
            return None
        failed = tuple((str(name), str(why)) for name, why in stats.get("failed", ()))
        return cls(int(stats["seq"]), frozenset(stats.get("adapters", ())), failed)


def holders(adapter: str, replicas: Sequence[str], holdings: Mapping[str, Holdings]) -> list[str]:
    """The replicas among `replicas` that may serve a request for `adapter` (in their order)."""
    if adapter == BASE:
        return list(replicas)
    return [r for r in replicas if r in holdings and adapter in holdings[r].adapters]


@dataclass(slots=True)
class HoldingsTable:
    """The latest snapshot per replica."""

    latest: dict[str, Holdings] = field(default_factory=dict)

    def note(self, replica: str, snapshot: Holdings | None) -> bool:
        """Keep `snapshot` unless the replica's kept one is as new or newer; True if kept."""
        if snapshot is None:
            return False
        kept = self.latest.get(replica)
        if kept is not None and kept.seq >= snapshot.seq:
            return False
        self.latest[replica] = snapshot
        return True

    def forget(self, replica: str) -> None:
        self.latest.pop(replica, None)

    def failures(self) -> dict[str, dict[str, str]]:
        """replica -> {adapter: why} for every replica whose start-up load of one failed."""
        return {r: dict(h.failed) for r, h in sorted(self.latest.items()) if h.failed}
