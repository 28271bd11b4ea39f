"""The gate's entry points to the whole-stack suite: run it on a model, or run it against one
server or router mutant and say whether it was caught and with which attribution class.

The gate's stage (`run_stack_stage`) runs the server cases on several tokenizers: the served
model's, then a SentencePiece-style and a byte-level BPE one trained here on a random Llama
(kvpage.verify.stack.tokenizer_dirs). Text bugs are tokenizer-shaped — a SentencePiece leading
space, a byte-fallback run, a byte-level piece that ends inside a character — and the built-in
models' byte tokenizer shows none of them. A server mutant is caught on the first tokenizer that
fails it; it is not applicable only where no tokenizer can show it."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpage.verify.diff import MutantAttribution
from kvpage.verify.stack.mutants import STACK_MUTANTS, StackMutant
from kvpage.verify.stack.router_model import router_cases
from kvpage.verify.stack.server_suite import server_cases
from kvpage.verify.stack.text_oracle import text_model
from kvpage.verify.suites import CaseResult

DEFAULT_SEED = 0
DEFAULT_BUDGET_S = 20.0
TRAINED_KINDS = ("spm", "bpe")  # kvpage.verify.stack.tokenizer_dirs.build's kinds


@dataclass(frozen=True, slots=True)
class TextTarget:
    """A model and its tokenizer the server cases run on; `label` goes in the cases' names."""

    model: object
    tokenizer: object
    model_name: str
    label: str = ""


def run_server_suite(
    model,
    tokenizer,
    model_name: str,
    seed: int = DEFAULT_SEED,
    budget_s: float = DEFAULT_BUDGET_S,
) -> list[CaseResult]:
    """The server cases (two apps) then the router cases. Past `budget_s` the remaining
    generated requests are skipped (each case's `requests` says how many ran); the router
    cases take well under a second and always run. A model without a tokenizer (no text to
    judge) gets the router cases only."""
    deadline = time.perf_counter() + budget_s
    router = router_cases(seed)
    if tokenizer is None or text_model(model_name, tokenizer) is None:
        return router
    return server_cases(model, tokenizer, model_name, seed, deadline) + router


def trained_targets(root: Path) -> list[TextTarget]:
    """Random Llamas with the trained SentencePiece-style and byte-level BPE tokenizers, built
    under `root` (a second or two each)."""
    import torch

    from kvpage.model import load_model
    from kvpage.verify.stack.tokenizer_dirs import build

    targets = []
    for kind in TRAINED_KINDS:
        directory = str(build(root / kind, kind))
        model, tokenizer = load_model(directory, torch.float32)
        targets.append(TextTarget(model, tokenizer, directory, f"[{kind}]"))
    return targets


def run_stack_stage(
    served: TextTarget, mutants: list[StackMutant], seed: int = DEFAULT_SEED
) -> tuple[list[CaseResult], list[StackMutantResult]]:
    """The server cases on the served model and on each trained tokenizer, the router cases
    once; then each mutant, a server one on one target after another until it is caught."""
    with tempfile.TemporaryDirectory(prefix="kvpage-stack-") as root:
        targets = [served, *trained_targets(Path(root))]
        texts = [t for t in targets if t.tokenizer is not None]
        cases = []
        for t in texts:
            deadline = time.perf_counter() + DEFAULT_BUDGET_S
            cases += server_cases(t.model, t.tokenizer, t.model_name, seed, deadline, label=t.label)
        cases += router_cases(seed)
        return cases, [_run_on_targets(m, texts, seed) for m in mutants]


def _run_on_targets(mutant: StackMutant, targets: list[TextTarget], seed: int):
    if mutant.layer != "server":
        return run_server_mutant(mutant, None, None, "", seed)
    results = []
    for t in targets:
        result = run_server_mutant(mutant, t.model, t.tokenizer, t.model_name, seed, label=t.label)
        if result.caught:
            result.seconds += sum(r.seconds for r in results)
            return result
        results.append(result)
    ran = [r for r in results if r.not_applicable is None]
    if not ran:
        return results[0]  # no tokenizer can show it: the first one's reason
    ran[-1].seconds = sum(r.seconds for r in results)
    return ran[-1]


@dataclass(slots=True)
class StackMutantResult(MutantAttribution):
    """Like the gate's MutantResult: `divergence` is Divergence.to_dict() of the first one."""

    mutant: StackMutant
    caught: bool
    caught_by: list[str]
    first_failure: str | None
    divergence: dict | None
    seconds: float
    cases: list[CaseResult] = field(default_factory=list)
    not_applicable: str | None = None  # as the gate's MutantResult: why it cannot show here


def run_server_mutant(
    mutant: StackMutant,
    model,
    tokenizer,
    model_name: str,
    seed: int = DEFAULT_SEED,
    budget_s: float = DEFAULT_BUDGET_S,
    label: str = "",
) -> StackMutantResult:
    """The suite of the mutant's layer with the mutant planted in every app (or router) it
    builds, until the first case that fails."""
    start = time.perf_counter()
    if mutant.not_applicable is not None:
        why = mutant.not_applicable(text_model(model_name, tokenizer))
        if why is not None:
            return StackMutantResult(mutant, False, [], None, None, 0.0, [], why)
    if mutant.layer == "server":
        deadline = start + budget_s
        cases = server_cases(
            model, tokenizer, model_name, seed, deadline, mutant.apply, True, label
        )
    else:
        cases = router_cases(seed, mutant.apply)
    failed = [c for c in cases if not c.passed]
    first = failed[0] if failed else None
    divergence = first.first_divergence if first else None
    return StackMutantResult(
        mutant,
        bool(failed),
        [c.case for c in failed],
        f"{first.case}: {first.failures[0].message}" if first else None,
        None if divergence is None else divergence.to_dict(),
        time.perf_counter() - start,
        cases,
    )


__all__ = [
    "STACK_MUTANTS",
    "TextTarget",
    "run_stack_stage",
    "StackMutant",
    "StackMutantResult",
    "run_server_mutant",
    "run_server_suite",
]
