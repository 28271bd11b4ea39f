"""API keys -> tenants -> cache salts.

With keys configured the salt comes from the tenant, never from the client: a client that could pick
a salt could pick another tenant's and time its cache hits (the lesson of vLLM's CVE-2025-46570).
The salt is a keyed hash of the tenant, with a secret made at start-up, so it cannot be guessed from
the tenant's name either. Replicas of one service are given the same secret (made once by the
process that deploys them), so a tenant's salt is the same on every replica."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from kvpage.server.protocol import ApiError


def load_api_keys(path: str | Path) -> dict[str, str]:
    """A JSON object {"key": "tenant"} or lines `key tenant` (blank lines and # comments skipped).
    Raises ValueError naming the file and what is wrong with it (unreadable included)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the API key file ({_reason(err)})") from err
    pairs = _json_pairs(path, text) if text.lstrip().startswith("{") else _line_pairs(path, text)
    if not pairs:
        raise ValueError(f"{path}: no API keys in the file")
    keys: dict[str, str] = {}
    for key, tenant in pairs:
        if not (isinstance(key, str) and isinstance(tenant, str) and key and tenant):
            raise ValueError(f"{path}: keys and tenants must be non-empty strings")
        if key in keys:  # which tenant would it be? refuse rather than pick one
            raise ValueError(f"{path}: a key is listed twice")
        keys[key] = tenant
    return keys


def _json_pairs(path: str | Path, text: str) -> list[tuple[object, object]]:
    try:  # as pairs, duplicates included (a dict would silently keep the last)
        return json.loads(text, object_pairs_hook=list)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err


def _line_pairs(path: str | Path, text: str) -> list[tuple[str, str]]:
    rows = [ln.split() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    for number, row in enumerate(rows, 1):
        if len(row) != 2:  # never echo the line: it may hold a key
            raise ValueError(f"{path}: entry {number} is not `key tenant` ({len(row)} fields)")
    return [(key, tenant) for key, tenant in rows]


def _reason(err: Exception) -> str:
    return err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__


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
