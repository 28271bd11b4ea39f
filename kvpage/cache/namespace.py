"""Cache namespace: every input that changes what a KV block means, hashed into the chain root.

Two requests may share a block only if their namespaces are equal. The digest is SHA-256 over
name-tagged, type-tagged, length-prefixed fields, so field boundaries cannot be moved
(("ab", "c") != ("a", "bc")), None differs from "" and a value in one field never equals the same
value in another field (adapter "X" vs cache salt "X").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvpage.errors import InvalidRequest

_DOMAIN = b"kvpage.cache.namespace.v1"


def canonical_config(config: Mapping[str, Any] | None) -> str:
    """Stable text for a RoPE / position config mapping (key order does not matter)."""
    return json.dumps(config or {}, sort_keys=True, separators=(",", ":"), default=str)


def _encode_field(name: str, value: object) -> bytes:
    if value is None:
        tag, payload = b"N", b""
    elif isinstance(value, bool):  # before int: bool is an int subclass
        tag, payload = b"b", b"\x01" if value else b"\x00"
    elif isinstance(value, int):
        tag, payload = b"i", str(value).encode()
    elif isinstance(value, str):
        tag, payload = b"s", value.encode("utf-8")
    else:
        raise InvalidRequest(f"namespace field {name}: unsupported type {type(value).__name__}")
    name_b = name.encode()
    return len(name_b).to_bytes(4, "big") + name_b + tag + len(payload).to_bytes(8, "big") + payload


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    model_revision: str
    tokenizer_revision: str
    adapter: str | None = None  # None = no adapter; "" is a (strange) adapter named ""
    rope_config: str = "{}"  # canonical_config(...) of rope theta/scaling/max positions/pos type
    kv_dtype: str = "float16"
    kv_layout_version: int = 1
    block_size: int = 16
    cache_salt: str | None = None  # per-request tenant isolation
    _digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model_revision", "tokenizer_revision", "rope_config", "kv_dtype"):
            if not isinstance(getattr(self, name), str):
                raise InvalidRequest(f"namespace field {name} must be a str")
        for name in ("adapter", "cache_salt"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequest(f"namespace field {name} must be a str or None")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise InvalidRequest(f"namespace block_size must be a positive int: {self.block_size}")
        if not isinstance(self.kv_layout_version, int):
            raise InvalidRequest("namespace kv_layout_version must be an int")
        object.__setattr__(self, "_digest", self._compute_digest())

    def _compute_digest(self) -> bytes:
        h = hashlib.sha256(_DOMAIN)
        for f in fields(self):
            if f.init:
                h.update(_encode_field(f.name, getattr(self, f.name)))
        return h.digest()

    def digest(self) -> bytes:
        return self._digest

    def with_salt(self, cache_salt: str | None) -> CacheNamespace:
        return replace(self, cache_salt=cache_salt)

    def with_adapter(self, adapter: str | None) -> CacheNamespace:
        return replace(self, adapter=adapter)
