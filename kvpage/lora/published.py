"""What threads other than the engine's may read of its adapters: an immutable snapshot of the
registered adapters (name, path, identity), built and published by the engine thread after every
load and unload (kvpage.lora.slots.LoraSlots.published).

Why a snapshot: the server's event-loop thread answers /v1/models and resolves a request's
`model` to an adapter while the engine thread loads and unloads adapters. A reader that walked
the engine's own registry, or held its mutable adapter objects, could see it between two
changes; a snapshot is replaced by one attribute store and never changed after, so a reader that
takes it once sees one published state, whole."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class PublishedAdapter:
    name: str
    path: str  # the PEFT directory it was loaded from
    identity: str  # its cache namespace field: name and weights digest


@dataclass(frozen=True, slots=True)
class AdapterSnapshot:
    version: int = 0  # one more per publication
    # name -> its adapter, read-only
    by_name: Mapping[str, PublishedAdapter] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, version: int, adapters) -> AdapterSnapshot:
        """A snapshot of `adapters` (objects with name, path and identity), copied now."""
        entries = {a.name: PublishedAdapter(a.name, a.path, a.identity) for a in adapters}
        return cls(version, MappingProxyType(dict(sorted(entries.items()))))

    @property
    def names(self) -> tuple[str, ...]:
        """Every adapter's name, sorted."""
        return tuple(self.by_name)

    def get(self, name: str) -> PublishedAdapter | None:
        return self.by_name.get(name)


EMPTY = AdapterSnapshot()
