"""The prefix-caching kill switch per tenant (LLMEngine.set_namespace_caching): a tenant is a
cache salt, and its requests with an adapter are keyed in namespaces of their own under it, so
the switch follows every adapter namespace seen under the salt, now and later."""

from __future__ import annotations

from kvpage.cache.manager import KVCacheManager


class TenantSwitches:
    def __init__(self, cache: KVCacheManager) -> None:
        self.cache = cache
        self.salts_off: set[str | None] = set()
        self.adapter_namespaces: dict[str | None, set[bytes]] = {}  # salt -> digests seen

    def set(self, cache_salt: str | None, enabled: bool, salt_digest: bytes) -> None:
        """While off, no hit and no publish for requests of the salt (namespace `salt_digest`),
        with an adapter or without."""
        (self.salts_off.discard if enabled else self.salts_off.add)(cache_salt)
        for digest in {salt_digest} | self.adapter_namespaces.get(cache_salt, set()):
            self.cache.set_namespace_enabled(digest, enabled)

    def follow(self, cache_salt: str | None, digest: bytes) -> None:
        """An adapter namespace under `cache_salt`: remembered for the salt's switch, and off
        now if the salt is."""
        self.adapter_namespaces.setdefault(cache_salt, set()).add(digest)
        if cache_salt in self.salts_off:
            self.cache.set_namespace_enabled(digest, False)
