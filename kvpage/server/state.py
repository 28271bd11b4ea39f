"""Server options and the live state the routes share (one per app)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpage.server.audit import AuditLog
from kvpage.server.chat import Messages
from kvpage.server.engine_loop import EngineLoop
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


@dataclass(slots=True)
class ServerState:
    options: ServerOptions
    loop: EngineLoop
    metrics: ServerMetrics
    audit: AuditLog
    tenants: Tenants
    shadow: ShadowChecker
    chat_template: Callable[[Messages], str]
    draining: bool = False  # admin switch: refuse new requests, finish running ones
