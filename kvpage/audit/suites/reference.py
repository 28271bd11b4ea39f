"""The independent reference (`--reference-model DIR`): every answer the other suites judged —
solo, cold, warm, batched — against what kvpage's contiguous reference generator says the same
checkpoint answers to the same prompt alone. A server whose cold and warm answers are wrong
alike (a phantom hit that every request gets) passes every self-comparison and fails here.

Sent nothing: it runs on the answers already in hand. The reference is another implementation
(other kernels, perhaps another dtype), so the drift bound is the configured tolerance (never
tightened to the server's own batching drift), at least the server's logprob resolution."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvpage.audit.classify import DRIFT, ISOLATION, Noise, classify
from kvpage.audit.compare import first_divergence, max_logprob_delta
from kvpage.audit.completion import Completion, token_key
from kvpage.audit.suites.base import UNTESTABLE, Check, SuiteContext, SuiteResult

if TYPE_CHECKING:
    from kvpage.audit.reference import Reference

NAME = "reference"
JUDGED = ("baseline", "batch", "prefix", "canaries")


def run(ctx: SuiteContext, results: list[SuiteResult], reference: Reference) -> SuiteResult:
    result = SuiteResult(NAME, UNTESTABLE)
    answers = _answers(results)
    if ctx.caps.token_ids_field is None:
        result.untested.append("the server gives no output token ids: nothing to compare by id")
        return result
    if not answers:
        result.untested.append("no answers to token-id prompts with logprobs were judged")
        return result
    noise = Noise(measured=True, resolution=ctx.noise.resolution)
    for label, answer in answers:
        mine = reference.answer(answer.prompt_ids, len(answer.token_ids), ctx.caps.ignore_eos)
        check = _judge(ctx, label, mine, by_id(answer), noise)
        result.checks.append(check)
    result.verdict = result.judged_verdict()
    result.data = agreement(result.checks)
    result.data["reference"] = {"model": reference.name, "dtype": reference.dtype}
    result.summary = _summary(result.data)
    return result


def _answers(results: list[SuiteResult]) -> list[tuple[str, Completion]]:
    """Each distinct answer with ids, logprobs and an id prompt, labelled by where it came from."""
    seen, out = set(), []
    for suite in (s for s in results if s.name in JUDGED):
        for check in suite.checks:
            for side, answer in (("solo", check.ref), ("other", check.cand)):
                if id(answer) in seen or not _comparable(answer):
                    continue
                seen.add(id(answer))
                out.append((f"{suite.name}/{check.name}/{side}", answer))
    return out


def _comparable(answer: Completion) -> bool:
    return bool(answer.prompt_ids) and bool(answer.token_ids) and answer.logprobs is not None


def by_id(answer: Completion) -> Completion:
    """The server's answer spelled by token id, as the reference's is; its top-k only where it
    is keyed by id too (vLLM's return_tokens_as_token_ids, llama.cpp)."""
    ids = list(answer.token_ids or [])
    top = answer.top if _keyed_by_id(answer.top) else None
    view = Completion(answer.text, answer.finish_reason, token_ids=ids, top=top)
    view.tokens, view.logprobs = [token_key(i) for i in ids], answer.logprobs
    view.cached_tokens, view.prompt_tokens = answer.cached_tokens, answer.prompt_tokens
    return view


def _keyed_by_id(top: list[dict[str, float]] | None) -> bool:
    return bool(top) and all(k.startswith("token_id:") for t in top for k in t)


def _judge(
    ctx: SuiteContext, label: str, mine: Completion, theirs: Completion, noise: Noise
) -> Check:
    div = first_divergence(mine, theirs, ctx.cfg.tolerances.exact)
    context = {"mode": "against the reference", "prompt": f"{len(theirs.token_ids or [])} ids"}
    check = Check(NAME, label, context, mine, theirs, div)
    if div is not None:
        verdict = classify(div, noise, ctx.cfg.tolerances)
        check.klass, check.reason = verdict.klass, f"vs reference: {verdict.reason}"
    return check


def agreement(checks: list[Check]) -> dict:
    """How close the server comes to the reference: the answers whose tokens all agree, the
    largest |Δ logprob| among them, and the flips by class."""
    same = [c for c in checks if c.divergence is None or c.divergence.logprob_only]
    deltas = [max_logprob_delta(c.ref, c.cand) or 0.0 for c in same]
    deltas = [d for d in deltas if not math.isnan(d)]
    return {
        "answers": len(checks),
        "same_tokens": len(same),
        "max_logprob_delta_same_tokens": max(deltas, default=0.0),
        "drift_flips": sum(1 for c in checks if c.klass == DRIFT and c not in same),
        "isolation": sum(1 for c in checks if c.klass == ISOLATION),
    }


def _summary(data: dict) -> str:
    return (
        f"{data['same_tokens']} of {data['answers']} answers have the reference's tokens "
        f"(logprobs within {data['max_logprob_delta_same_tokens']:.3g}); "
        f"{data['drift_flips']} flip(s) at near-ties, {data['isolation']} beyond drift"
    )
