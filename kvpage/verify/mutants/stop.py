"""Stop-rule mutants (R34): the request ends one token early or late, or never on EOS. Each wraps
an engine method through its seam; the diff must report a stop_rule divergence."""

from __future__ import annotations

from dataclasses import replace

from kvpage.engine.engine import LLMEngine
from kvpage.verify.mutants.base import Mutant, _bind


def _wrap_new_sequence(engine: LLMEngine, adjust) -> None:
    original = engine._new_sequence

    def new_sequence(self, *args, **kwargs):
        seq = original(*args, **kwargs)
        adjust(self, seq)
        return seq

    _bind(engine, "_new_sequence", new_sequence)


def eos_not_a_stop(engine: LLMEngine) -> None:
    """The stop set is built from the request's stop_token_ids only: EOS never ends anything."""

    def adjust(self, seq):
        seq.stop_ids = frozenset(seq.params.stop_token_ids)

    _wrap_new_sequence(engine, adjust)


def max_tokens_off_by_one(engine: LLMEngine) -> None:
    """The length check runs after one more token (`>` where `>=` was meant)."""

    def adjust(self, seq):
        seq.params = replace(seq.params, max_tokens=seq.params.max_tokens + 1)

    _wrap_new_sequence(engine, adjust)


def stop_one_token_late(engine: LLMEngine) -> None:
    """The stop check looks at the previous token: a request stops one token after its stop."""
    original = engine._append_token

    def append_token(self, seq, token, logits):
        stops = seq.stop_ids
        previous_was_stop = bool(seq.output_ids) and seq.output_ids[-1] in stops
        seq.stop_ids = frozenset()
        try:
            original(seq, token, logits)
        finally:
            seq.stop_ids = stops
        if previous_was_stop and not seq.finished:
            self._finish(seq, "stop")

    _bind(engine, "_append_token", append_token)


STOP_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "eos_not_a_stop",
        "EOS left out of the stop set",
        "stop_rule",
        eos_not_a_stop,
        suites=("stop",),
    ),
    Mutant(
        "max_tokens_off_by_one",
        "one token more than max_tokens",
        "stop_rule",
        max_tokens_off_by_one,
        suites=("stop",),
    ),
    Mutant(
        "stop_one_token_late",
        "stop checked on the previous token",
        "stop_rule",
        stop_one_token_late,
        suites=("stop",),
    ),
)
