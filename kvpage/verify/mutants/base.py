"""What a mutant is, and the one way it patches an engine instance: through a named seam that must
exist (a renamed seam fails loudly at apply time instead of showing up as a "missed" mutant)."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpage.config import ModelConfig
from kvpage.engine.engine import LLMEngine
from kvpage.errors import KVPageError


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    bug: str
    expected_class: str  # attribution class its first divergence must get
    apply: Callable[[LLMEngine], None]
    config: dict = field(default_factory=dict)  # EngineConfig overrides the bug needs
    # Suites run first against this mutant (the rest follow): only the order, and so the gate's
    # time, depends on it; any case of any suite may catch it.
    suites: tuple[str, ...] = ()
    # The pool format the bug lives in (a quantized KV dtype), or None for any: the gate runs
    # such a mutant only when it runs suites in that format.
    kv_cache_dtype: str | None = None
    # Why the bug cannot be expressed on a model of a given shape (None: it can). The gate
    # reports such a mutant "not applicable" with the reason: neither caught nor missed.
    not_applicable_on: Callable[[ModelConfig], str | None] | None = None

    def not_applicable(self, cfg: ModelConfig) -> str | None:
        return None if self.not_applicable_on is None else self.not_applicable_on(cfg)


class MissingSeam(KVPageError, AttributeError):
    """A mutant targets an attribute the engine no longer has."""


def _bind(obj, name: str, fn) -> None:
    """Replace method `name` of one instance; the method must already exist."""
    if not callable(getattr(obj, name, None)):
        raise MissingSeam(f"{type(obj).__name__} has no method {name!r} to patch")
    setattr(obj, name, types.MethodType(fn, obj))


def _replace(obj, name: str, value) -> None:
    """Replace attribute `name` of one instance; the attribute must already exist."""
    if not hasattr(obj, name):
        raise MissingSeam(f"{type(obj).__name__} has no attribute {name!r} to replace")
    setattr(obj, name, value)
