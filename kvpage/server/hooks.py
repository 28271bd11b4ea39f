"""Engine events the server audits but the engine does not emit yet (preempt, free, restore).

This is the only module that patches the engine, and it does so on the instance: `install_hooks`
wraps `engine.scheduler.preempt`, `engine.swap_in` and `engine._finish` so each call also writes an
audit line (and a restore-latency sample), and sets `engine.cache.audit_sink` for prefix hits and
corruptions. Behaviour is unchanged: every wrapper calls the original with the same arguments and
returns its result. Each runs on the engine thread, where the engine calls the original."""

from __future__ import annotations

import time
from typing import Any

from kvpage.engine.engine import LLMEngine
from kvpage.engine.sequence import Sequence
from kvpage.server.audit import AuditLog
from kvpage.server.metrics import ServerMetrics


def install_hooks(engine: LLMEngine, audit: AuditLog, metrics: ServerMetrics) -> None:
    engine.cache.audit_sink = lambda event: audit.cache_event(event, _request_of(engine, event))
    _wrap_preempt(engine, audit)
    _wrap_swap_in(engine, audit, metrics)
    _wrap_finish(engine, audit)


def _wrap_preempt(engine: LLMEngine, audit: AuditLog) -> None:
    original = engine.scheduler.preempt

    def preempt(seq: Sequence, out: Any, mode: str | None = None) -> str:
        held = _blocks(engine, seq)  # before: preemption gives them away
        used = original(seq, out, mode)
        audit.write("preempt", request_id=seq.sample_id, mode=used, **held)
        return used

    engine.scheduler.preempt = preempt


def _wrap_swap_in(engine: LLMEngine, audit: AuditLog, metrics: ServerMetrics) -> None:
    original = engine.swap_in

    def swap_in(seq: Sequence) -> None:
        start = time.perf_counter()
        original(seq)
        latency = time.perf_counter() - start
        metrics.restore_latency.observe(latency)
        audit.write(
            "restore",
            request_id=seq.sample_id,
            mode="swap",
            latency_s=latency,
            **_blocks(engine, seq),
        )

    engine.swap_in = swap_in


def _wrap_finish(engine: LLMEngine, audit: AuditLog) -> None:
    original = engine._finish

    def finish(seq: Sequence, reason: str) -> None:
        held = _blocks(engine, seq)
        original(seq, reason)
        audit.write("free", request_id=seq.sample_id, reason=reason, **held)

    engine._finish = finish


def _blocks(engine: LLMEngine, seq: Sequence) -> dict[str, list[int]]:
    pool = engine.cache.pool
    ids = list(seq.table.block_ids)
    return {"blocks": ids, "generations": [pool.blocks[b].generation for b in ids]}


def _request_of(engine: LLMEngine, event: Any) -> str | None:
    seq_id = getattr(event, "seq_id", None)
    samples = (s for group in engine.samples.values() for s in group)
    return next((s.sample_id for s in samples if s.seq_id == seq_id), None)
