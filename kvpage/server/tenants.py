"""API keys -> tenants -> cache salts (R5).

With keys configured the salt comes from the tenant, never from the client: a client that could pick
a salt could pick another tenant's and time its cache hits (the lesson of vLLM's CVE-2025-46570).
The salt is a keyed hash of the tenant, with a secret made at start-up, so it cannot be guessed from
the tenant's name either."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from kvpage.server.protocol import ApiError


def load_api_keys(path: str | Path) -> dict[str, str]:
    """A JSON object {"key": "tenant"} or lines `key tenant` (blank lines and # comments skipped)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        keys = json.loads(text)
    else:
        rows = [ln.split() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
        bad = [r for r in rows if len(r) != 2]
        if bad:
            raise ValueError(f"{path}: each line must be `key tenant`, got {bad[0]}")
        keys = dict(rows)
    if not keys or not all(isinstance(k, str) and isinstance(t, str) for k, t in keys.items()):
        raise ValueError(f"{path}: no keys, or a key/tenant that is not a string")
    return keys


@dataclass(slots=True)
class Tenants:
    keys: dict[str, str] = field(default_factory=dict)  # api key -> tenant; empty: open server
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of a `Bearer <key>` header; None on an open server; 401 otherwise."""
        if not self.enabled:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        for known, tenant in self.keys.items():
            if scheme.lower() == "bearer" and hmac.compare_digest(known, key.strip()):
                return tenant
        raise ApiError("invalid or missing API key", None, 401, "authentication_error")

    def salt_for(self, tenant: str) -> str:
        return hmac.new(self.secret, tenant.encode(), hashlib.sha256).hexdigest()

    def cache_salt(self, tenant: str | None, requested: str | None) -> str | None:
        """The salt a request is keyed with: the tenant's, or on an open server the client's."""
        if tenant is None:
            return requested
        if requested is not None:
            raise ApiError("cache_salt is set by the server from your API key", "cache_salt")
        return self.salt_for(tenant)
