"""Namespace and kill-switch mutants: the salt collapsed, switches that stop hits
but not publishes, a per-tenant switch keyed without the tenant's salt."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvpage.cache.namespace import CacheNamespace
from kvpage.engine.engine import LLMEngine
from kvpage.verify.mutants.base import bind, mutant_table, replace


@dataclass(frozen=True, slots=True)
class _EmptySaltIsNone(CacheNamespace):
    def with_salt(self, cache_salt):
        return CacheNamespace.with_salt(
            self, cache_salt or None
        )  # "" falls into the unsalted space


def empty_salt_is_no_salt(engine: LLMEngine) -> None:
    ns = engine.namespace
    values = {f.name: getattr(ns, f.name) for f in fields(ns) if f.init}
    replace(engine, "namespace", _EmptySaltIsNone(**values))


def _publish_ignoring_switches(engine: LLMEngine, per_namespace: bool, global_: bool) -> None:
    cache = engine.cache
    original = cache.publish_full_blocks

    def publish_full_blocks(self, table, chain):
        disabled, enabled = self.index.disabled, self.enable_prefix_caching
        if per_namespace:
            self.index.disabled = set()
        if global_:
            self.enable_prefix_caching = True
        try:
            original(table, chain)
        finally:
            self.index.disabled, self.enable_prefix_caching = disabled, enabled

    bind(cache, "publish_full_blocks", publish_full_blocks)


def tenant_switch_lookup_only(engine: LLMEngine) -> None:
    """A tenant's kill switch stops its hits but it keeps publishing."""
    _publish_ignoring_switches(engine, per_namespace=True, global_=False)


def global_switch_lookup_only(engine: LLMEngine) -> None:
    """The global kill switch stops hits but blocks are still published."""
    _publish_ignoring_switches(engine, per_namespace=False, global_=True)


def tenant_switch_ignores_salt(engine: LLMEngine) -> None:
    """The per-tenant switch is keyed by the engine's base namespace, not the tenant's."""

    def set_namespace_caching(self, cache_salt, enabled):
        self.cache.set_namespace_enabled(self.namespace.digest(), enabled)

    bind(engine, "set_namespace_caching", set_namespace_caching)


NAMESPACE_MUTANTS = mutant_table(
    "prefix_key",
    (
        ("empty_salt_is_no_salt", 'cache salt "" keyed like no salt', empty_salt_is_no_salt),
        (
            "tenant_switch_lookup_only",
            "tenant kill switch still publishes",
            tenant_switch_lookup_only,
        ),
        (
            "global_switch_lookup_only",
            "global kill switch still publishes",
            global_switch_lookup_only,
        ),
        (
            "tenant_switch_ignores_salt",
            "tenant kill switch keyed without the salt",
            tenant_switch_ignores_salt,
        ),
    ),
    suites=("namespaces",),
)
