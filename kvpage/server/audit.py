"""Audit log (R29): one JSON line per prefix hit and per preempt / free / restore, sampled at a
configurable rate; cache corruption and shadow-comparison alerts are always written.

Lines go to a file (`--audit-log`) or, without one, to the `kvpage.audit` logger; the last few
hundred also stay in memory for the admin API and tests."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpage.cache.events import AuditEvent, CorruptionEvent, HitEvent

log = logging.getLogger("kvpage.audit")


class AuditLog:
    def __init__(
        self, path: str | Path | None = None, sample_rate: float = 1.0, seed: int = 0
    ) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"audit sample rate must be in [0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.recent: deque[dict[str, Any]] = deque(maxlen=512)
        self._file = None if path is None else open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # written from the engine and shadow threads

    def write(self, event: str, always: bool = False, **fields: Any) -> None:
        with self._lock:
            if not always and self._random.random() >= self.sample_rate:
                return
            line = {"ts": round(time.time(), 6), "event": event}
            line.update((k, _plain(v)) for k, v in fields.items())
            self.recent.append(line)
            text = json.dumps(line)
            if self._file is None:
                log.info(text)
            else:
                self._file.write(text + "\n")
                self._file.flush()

    def cache_event(self, event: AuditEvent, request_id: str | None) -> None:
        """The cache manager's audit sink."""
        if isinstance(event, HitEvent):
            self.write("prefix_hit", request_id=request_id, **asdict(event))
        elif isinstance(event, CorruptionEvent):
            self.write("cache_corruption", always=True, **asdict(event))

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _plain(value: Any) -> Any:
    """Digests as hex, tuples as lists: what JSON (and the admin API) can carry."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple):
        return list(value)
    return value
