"""The whole stack under the gate: the OpenAI server driven in-process against a text-level
oracle, and the replica router against a brute-force model of its policy (kvpage.verify.stack.
suite has the entry points)."""

from kvpage.verify.stack.suite import (
    STACK_MUTANTS,
    StackMutant,
    StackMutantResult,
    TextTarget,
    run_server_mutant,
    run_server_suite,
    run_stack_stage,
)

__all__ = [
    "STACK_MUTANTS",
    "StackMutant",
    "StackMutantResult",
    "TextTarget",
    "run_server_mutant",
    "run_server_suite",
    "run_stack_stage",
]
