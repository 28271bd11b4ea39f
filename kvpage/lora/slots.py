"""The adapters an engine knows, and the bounded table of those resident for computing.

Registered adapters keep their float32 weights as loaded. At most `max_loras` are resident, in
the model's dtype and device: a request's adapter is made resident when the request is admitted
and held until its last sample finishes, so an adapter in use is never evicted; one not in use
is evicted least recently used first when another needs its slot. A request whose adapter cannot
become resident (every slot held) waits in the queue; those behind it that need no new slot are
admitted meanwhile (kvpage.engine.scheduler). `reader` reads PEFT directories for the engine.

`registered` is the engine thread's; other threads (the server's event loop) read `published`,
an immutable snapshot the engine thread replaces after every register and unregister
(kvpage.lora.published).

Resident adapters are computed from stacked slot tables (kvpage.lora.tables); `on_write`, when
set, hears of every slot written (a tensor-parallel engine sends it to its workers)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpage.errors import LoRAError
from kvpage.lora.adapter import LoraAdapter, PeftReader
from kvpage.lora.published import AdapterSnapshot
from kvpage.lora.tables import Factors, SlotTables


@dataclass(slots=True, eq=False)
class ResidentAdapter:
    adapter: LoraAdapter
    slot: int  # its columns of the stacked A^T tables and rows of the stacked B^T tables
    holds: int = 0


class LoraSlots:
    def __init__(
        self,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: str | torch.device,
        shard: Callable[[Factors], Factors] | None = None,
        on_write: Callable[[int, Factors], None] | None = None,
    ) -> None:
        self.max_loras, self.dtype, self.device = max_loras, dtype, device
        self.tables = SlotTables(max_loras, max_rank, dtype, device)
        self.shard = shard  # the full factors -> this rank's (tensor parallelism)
        self.on_write = on_write
        self.reader = PeftReader()  # how a PEFT directory becomes an adapter (engine loads)
        self.registered: dict[str, LoraAdapter] = {}  # name -> its current adapter
        self.published = AdapterSnapshot()  # what other threads read of `registered`
        self.resident: OrderedDict[str, ResidentAdapter] = OrderedDict()  # identity -> LRU last
        self.loads = 0  # adapters made resident (a reload or an eviction costs one)
        self.evictions = 0

    # --- registry --------------------------------------------------------------------------
    def register(self, adapter: LoraAdapter) -> LoraAdapter:
        """Known by its name from now on; a new adapter under a registered name replaces it for
        new requests (requests already queued keep the one they were given)."""
        self.registered = {**self.registered, adapter.name: adapter}
        self.publish()
        return adapter

    def unregister(self, name: str) -> None:
        if name not in self.registered:
            raise LoRAError(f"no adapter named {name!r} is loaded")
        adapter = self.registered[name]
        self.registered = {k: v for k, v in self.registered.items() if k != name}
        self.publish()
        held = self.resident.get(adapter.identity)
        if held is not None and held.holds == 0:
            del self.resident[adapter.identity]

    def publish(self) -> None:
        """Replace the snapshot other threads read by one of `registered` now (one attribute
        store: a reader sees the old snapshot or the new one, each whole)."""
        self.published = AdapterSnapshot.of(self.published.version + 1, self.registered.values())

    # --- residency -------------------------------------------------------------------------
    def can_hold(self, adapter: LoraAdapter) -> bool:
        if adapter.identity in self.resident or len(self.resident) < self.max_loras:
            return True
        return any(r.holds == 0 for r in self.resident.values())

    def hold(self, adapter: LoraAdapter) -> ResidentAdapter:
        """Make `adapter` resident (can_hold said it may be) and hold it once more."""
        resident = self.resident.get(adapter.identity)
        if resident is None:
            if len(self.resident) >= self.max_loras:
                self._evict_one()
            resident = ResidentAdapter(adapter, self._free_slot())
            self._write(resident.slot, self.factors(adapter))
            self.resident[adapter.identity] = resident
            self.loads += 1
        self.resident.move_to_end(adapter.identity)
        resident.holds += 1
        return resident

    def release(self, adapter: LoraAdapter) -> None:
        resident = self.resident.get(adapter.identity)
        if resident is None or resident.holds <= 0:
            raise LoRAError(f"adapter {adapter.name!r} released more often than held")
        resident.holds -= 1
        if resident.holds == 0 and self.registered.get(adapter.name) is not adapter:
            del self.resident[adapter.identity]  # unloaded or replaced: no new request needs it

    def in_use(self, name: str) -> bool:
        adapter = self.registered.get(name)
        held = None if adapter is None else self.resident.get(adapter.identity)
        return held is not None and held.holds > 0

    def _evict_one(self) -> None:
        for identity, resident in self.resident.items():  # least recently used first
            if resident.holds == 0:
                del self.resident[identity]
                self.evictions += 1
                return
        raise LoRAError("every adapter slot is in use")  # can_hold said otherwise: a bug

    def _free_slot(self) -> int:
        taken = {r.slot for r in self.resident.values()}
        return min(s for s in range(self.max_loras) if s not in taken)

    def _write(self, slot: int, factors: Factors) -> None:
        if self.on_write is not None:
            self.on_write(slot, factors)
        self.tables.write(slot, factors if self.shard is None else self.shard(factors))

    def factors(self, adapter: LoraAdapter):
        """(layer, module) -> (A^T, scale * B^T) in the tables' dtype (the model's, float32 for
        a 16-bit model: kvpage.lora.tables), each with its module's own scale (rank_pattern,
        alpha_pattern) (a declared seam)."""

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=self.tables.dtype).contiguous()

        return {
            where: (cast(a.t()), cast(b.t() * adapter.scale_of(where)))
            for where, (a, b) in adapter.weights.items()
        }
