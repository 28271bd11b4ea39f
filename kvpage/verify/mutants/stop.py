"""Stop-rule mutants: the request ends one token early or late, or never on EOS. Each
replaces the scheduler's stop rule (a declared seam); the diff must report a stop_rule
divergence."""

from __future__ import annotations

from kvpage.engine.engine import LLMEngine
from kvpage.verify.mutants.base import mutant_table, plant


def grammar_complete(seq) -> bool:
    """The honest rule's structured-output part, kept by every stop mutant: each plants one
    bug, and a grammar that keeps generating is a bug of its own (kvpage.verify.mutants
    .structured)."""
    return seq.grammar is not None and seq.grammar.finished


def eos_not_a_stop(engine: LLMEngine) -> None:
    """The stop set is built from the request's stop_token_ids only: EOS never ends anything."""

    def stop_reason(self, seq, token):
        if token in seq.params.stop_token_ids or grammar_complete(seq):
            return "stop"
        return "length" if len(seq.output_ids) >= seq.params.max_tokens else None

    plant(engine, "scheduler.stop_reason", stop_reason)


def max_tokens_off_by_one(engine: LLMEngine) -> None:
    """The length check runs after one more token (`>` where `>=` was meant)."""

    def stop_reason(self, seq, token):
        if token in seq.stop_ids or grammar_complete(seq):
            return "stop"
        return "length" if len(seq.output_ids) > seq.params.max_tokens else None

    plant(engine, "scheduler.stop_reason", stop_reason)


def stop_one_token_late(engine: LLMEngine) -> None:
    """The stop check looks at the previous token: a request stops one token after its stop."""

    def stop_reason(self, seq, token):
        if len(seq.output_ids) >= 2 and seq.output_ids[-2] in seq.stop_ids:
            return "stop"
        if grammar_complete(seq):
            return "stop"
        return "length" if len(seq.output_ids) >= seq.params.max_tokens else None

    plant(engine, "scheduler.stop_reason", stop_reason)


STOP_MUTANTS = mutant_table(
    "stop_rule",
    (
        ("eos_not_a_stop", "EOS left out of the stop set", eos_not_a_stop),
        ("max_tokens_off_by_one", "one token more than max_tokens", max_tokens_off_by_one),
        ("stop_one_token_late", "stop checked on the previous token", stop_one_token_late),
    ),
    suites=("stop",),
)
