"""Server options and the live state the routes share (one per app)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpage.server.audit import AuditLog
from kvpage.server.chat import Messages
from kvpage.server.engine_loop import EngineLoop, ServerShutdown
from kvpage.server.metrics import ServerMetrics
from kvpage.server.shadow import ShadowChecker
from kvpage.server.tenants import Tenants


@dataclass(frozen=True, slots=True)
class ServerOptions:
    model_name: str = "builtin:tiny-llama"  # what /v1/models lists and responses echo
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant; empty: open server
    admin_token: str | None = None  # None: /admin is disabled
    shadow_rate: float = 0.01
    audit_log: str | Path | None = None
    audit_sample_rate: float = 1.0
    seed: int = 0  # sampling of audit lines and shadow checks
    max_body_bytes: int = 4 * 1024 * 1024  # a larger request body is a 413, never parsed
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on shutdown


@dataclass(slots=True)
class ServerState:
    options: ServerOptions
    loop: EngineLoop
    metrics: ServerMetrics
    audit: AuditLog
    tenants: Tenants
    shadow: ShadowChecker
    chat_template: Callable[[Messages], str]
    draining: bool = False  # refuse new requests, finish running ones (admin switch, shutdown)

    async def shut_down(self, timeout: float, force: Callable[[], bool] = lambda: False) -> int:
        """Drain: admit nothing more, give the requests in flight up to `timeout` seconds (less
        if `force()` turns true), then end the rest with an error. Returns how many were cut."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.loop.in_flight and time.monotonic() < deadline and not force():
            await asyncio.sleep(0.05)
        cut = self.loop.in_flight
        if cut:
            self.loop.fail_in_flight(ServerShutdown("the server is shutting down"))
        return cut
