"""What a mutant is, and the only ways it may change an engine instance: replace a declared seam
(kvpage.engine.hooks), or replace or wrap a public method or attribute of an engine part. Private
names are refused here, and an AST test (tests/verify/test_mutant_seams.py) refuses them in any
mutant's body; a seam that is gone fails loudly at apply time instead of showing up as a
"missed" mutant."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpage.config import ModelConfig
from kvpage.engine.engine import LLMEngine
from kvpage.engine.hooks import SEAMS, owner_of
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
    # The weight format the bug lives in (EngineConfig.quantization, e.g. "int8"), or None for
    # any: on other weights the patched path computes nothing the bug changes, so the gate runs
    # such a mutant only on those weights (a matrix cell of them: kvpage.verify.matrix).
    weights: str | None = None
    # Why the bug cannot be expressed on a model of a given shape (None: it can). The gate
    # reports such a mutant "not applicable" with the reason: neither caught nor missed.
    not_applicable_on: Callable[[ModelConfig], str | None] | None = None
    # The bug lives in objects the model owns (a fast path's kernels): the mutant's engines get
    # a copy of the model of their own, the reference keeps the original.
    own_model: bool = False
    # The bug lives in structured outputs, which compile over the model's tokenizer: on a model
    # without one (the engine refuses every constraint) it is not applicable.
    needs_tokenizer: bool = False

    def not_applicable(self, cfg: ModelConfig) -> str | None:
        return None if self.not_applicable_on is None else self.not_applicable_on(cfg)


def mutant_table(expected_class: str, rows, **shared) -> tuple[Mutant, ...]:
    """Mutants of one bug class that share their other settings (suites, config, ...): one
    `(name, bug, apply)` row each."""
    return tuple(Mutant(name, bug, expected_class, apply, **shared) for name, bug, apply in rows)


class MissingSeam(KVPageError, AttributeError):
    """A mutant targets a seam or public attribute the engine no longer has, or a private one."""


def _public(obj, name: str) -> None:
    if name.startswith("_"):
        raise MissingSeam(
            f"{type(obj).__name__}.{name} is private: plant a bug through a declared seam "
            "(kvpage.engine.hooks) or a public method"
        )


def bind(obj, name: str, fn: Callable) -> None:
    """Replace public method `name` of one instance by `fn(self, ...)`."""
    _public(obj, name)
    if not callable(getattr(obj, name, None)):
        raise MissingSeam(f"{type(obj).__name__} has no method {name!r} to patch")
    setattr(obj, name, types.MethodType(fn, obj))


def replace(obj, name: str, value) -> None:
    """Replace public attribute `name` of one instance; the attribute must already exist."""
    _public(obj, name)
    if not hasattr(obj, name):
        raise MissingSeam(f"{type(obj).__name__} has no attribute {name!r} to replace")
    setattr(obj, name, value)


def plant(engine: LLMEngine, seam: str, fn: Callable) -> None:
    """Replace declared seam `seam` (e.g. "scheduler.stop_reason") by `fn(self, ...)`."""
    declared = SEAMS.get(seam)
    if declared is None:
        raise MissingSeam(f"{seam!r} is not a declared seam (kvpage.engine.hooks.SEAMS)")
    bind(owner_of(engine, declared), declared.attribute, fn)
