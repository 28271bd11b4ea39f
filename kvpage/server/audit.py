"""Audit log: one JSON line per engine event — prefix hit, copy-on-write, preempt, swap out,
swap in (the restore, with its latency), free, finish, abort, timeout — sampled at a configurable
rate; cache corruption, requests failed with an error and shadow-comparison alerts are always
written. Each line names the request and sample, the namespace digest (which identifies the
tenant and the adapter), the tenant, and the LoRA adapter of a request that runs with one; the
cache salt itself is not written, since it is the tenant's isolation key. When the engine
speculates, each finish line also carries the sample's draft tokens proposed and accepted
(num_draft_tokens, num_accepted_tokens: what RequestMetrics sums over a request's samples).

`AuditObserver` is the engine observer that feeds it; admin switch changes are written by the
admin API. Lines go to a file (`kvpage serve` writes ./kvpage-audit.jsonl unless `--audit-log`
names another file, or `-` for stderr) or, in an app built without a path, to the `kvpage.audit`
logger; the last few hundred also stay in memory for the admin
API and tests."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpage.engine.events import EngineEvent, EngineObserver, Finished

if TYPE_CHECKING:
    from kvpage.engine.plan import StepBatch
    from kvpage.engine.sequence import Sequence

log = logging.getLogger("kvpage.audit")


class AuditLog:
    def __init__(
        self,
        path: str | Path | None = None,
        sample_rate: float = 1.0,
        seed: int = 0,
        replica: str | None = None,
    ) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"audit sample rate must be in [0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.replica = replica  # None: a single server, and its lines carry no replica field
        self.recent: deque[dict[str, Any]] = deque(maxlen=512)
        self._file = None if path is None else open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # written from the engine and shadow threads
        # request id -> tenant name, and -> adapter name if it runs with one, while the request
        # runs (set and cleared by the server: `admit`, `forget`)
        self.tenants: dict[str, str | None] = {}
        self.adapters: dict[str, str] = {}

    def admit(self, request_id: str, tenant: str | None, adapter: str | None) -> None:
        self.tenants[request_id] = tenant
        if adapter is not None:
            self.adapters[request_id] = adapter

    def forget(self, request_id: str) -> None:
        self.tenants.pop(request_id, None)
        self.adapters.pop(request_id, None)

    def write(self, event: str, always: bool = False, **fields: Any) -> None:
        with self._lock:
            if not always and self._random.random() >= self.sample_rate:
                return
            line = {"ts": round(time.time(), 6), "event": event}
            if self.replica is not None:
                line["replica"] = self.replica
            line.update((k, _plain(v)) for k, v in fields.items())
            self.recent.append(line)
            text = json.dumps(line)
            if self._file is None:
                log.info(text)
            else:
                self._file.write(text + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class AuditObserver(EngineObserver):
    """Engine events -> audit lines, on the engine thread. Each line names the tenant (the API
    key's tenant name, registered by the server while the request runs; None on an open
    server), never the cache salt derived from it."""

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit

    def on_event(self, event: EngineEvent) -> None:
        fields = asdict(event)
        fields["tenant"] = self.audit.tenants.get(event.request_id)  # never the salt
        adapter = self.audit.adapters.get(event.request_id)
        if adapter is not None:  # the base model's lines stay as they were
            fields["adapter"] = adapter
        finished = isinstance(event, Finished)
        if finished:
            fields.update(self.finish_fields(event))
        alert = event.kind == "cache_corruption" or (finished and event.reason == "error")
        self.audit.write(event.kind, always=alert, **fields)
        if finished and event.sample_id == event.request_id:
            self.audit.forget(event.request_id)  # n == 1: that was its last line

    def finish_fields(self, event: Finished) -> dict[str, Any]:
        """What a finish line carries beyond the event's own fields."""
        return {}


class SpeculativeAuditObserver(AuditObserver):
    """The audit observer of an engine that speculates: each finish line also carries the
    sample's draft tokens proposed and accepted. They are read off the sample's sequence, kept
    from the first step it verified drafts in until its Finished event (by then its last
    verification is counted in it); a sample that never verified one has 0 and 0."""

    def __init__(self, audit: AuditLog) -> None:
        super().__init__(audit)
        self.speculated: dict[str, Sequence] = {}  # sample id -> its sequence

    def on_batch(self, batch: StepBatch) -> None:
        for item in batch.spec_seqs:
            self.speculated[item.seq.sample_id] = item.seq

    def finish_fields(self, event: Finished) -> dict[str, Any]:
        seq = self.speculated.pop(event.sample_id, None)
        return {
            "num_draft_tokens": 0 if seq is None else seq.num_draft_tokens,
            "num_accepted_tokens": 0 if seq is None else seq.num_accepted_tokens,
        }


def audit_observer(audit: AuditLog, speculating: bool) -> AuditObserver:
    """The observer that feeds `audit` from an engine (one that speculates or not): a plain
    engine's steps pay nothing for speculation's counts."""
    return SpeculativeAuditObserver(audit) if speculating else AuditObserver(audit)


def _plain(value: Any) -> Any:
    """Digests as hex, tuples as lists: what JSON (and the admin API) can carry."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple):
        return list(value)
    return value
