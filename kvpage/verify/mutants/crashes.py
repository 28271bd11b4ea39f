"""A bug that raises inside an engine step: the case crashes, and the gate must say so as a
finding of its own class (`crash`) with the step it happened in, not as a missed mutant or a
divergence of some cache class."""

from __future__ import annotations

from kvpage.engine.engine import LLMEngine
from kvpage.verify.mutants.base import mutant_table, plant
from kvpage.verify.mutants.stop import grammar_complete


def _stop_window_indexes_past_start(engine: LLMEngine) -> None:
    """The stop rule reads the last 4 output tokens for a multi-token stop before a request has
    4 of them (an IndexError on a request's 1st-3rd token once it has decoded one)."""

    def stop_reason(self, seq, token):
        if token in seq.stop_ids or grammar_complete(seq):
            return "stop"
        if len(seq.output_ids) > 1:
            tail = [seq.output_ids[-i] for i in range(1, 5)]
            if tail == [token] * 4:
                return "stop"
        return "length" if len(seq.output_ids) >= seq.params.max_tokens else None

    plant(engine, "scheduler.stop_reason", stop_reason)


CRASH_MUTANTS = mutant_table(
    "crash",
    (
        (
            "stop_window_indexes_past_start",
            "the stop rule reads 4 output tokens back before a request has 4 (IndexError)",
            _stop_window_indexes_past_start,
        ),
    ),
    suites=("stop",),
)
