"""Structured outputs in the gate, checked from outside the engine:

  walk      the verifier's own matcher (kvpage.reference.grammar) walked over the tokens a
            constrained sample drew: the mask before each token, for the sampling oracle, and
            the first token the grammar refuses (a draw outside the mask)
  checker   every constrained output that finished with "stop" validated without llguidance:
            `jsonschema` for a schema, json.loads for json_object (an object), Python's
            `re.fullmatch` for a regex, membership for a choice; a Lark/GBNF grammar is
            re-parsed by a fresh matcher of the verifier's own
  error     a constrained sample that ends with "error" (the engine refused a token: its mask
            and its matcher disagree)

Each failure is attributed to the `structured` class (kvpage.verify.diff)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import jsonschema
import torch

from kvpage.reference.grammar import ReferenceGrammars
from kvpage.reference.records import StepRecord, grammar_note
from kvpage.structured_params import StructuredOutputsParams
from kvpage.verify.checks import Failure
from kvpage.verify.diff import Divergence, RequestContext, structured_attribution


@dataclass(slots=True)
class GrammarWalk:
    masks: list[torch.Tensor] = field(default_factory=list)  # (V,) bool before each token
    refused_at: int | None = None  # the first token the grammar does not allow
    error: str = ""
    stopped: bool = False  # the grammar was complete after the last token walked
    accepting: bool = False


def walk(
    grammars: ReferenceGrammars, constraint: StructuredOutputsParams, tokens: list[int]
) -> GrammarWalk:
    """A fresh matcher of the verifier's own, fed `tokens` one by one."""
    matcher = grammars.matcher(constraint)
    out = GrammarWalk()
    for i, token in enumerate(tokens):
        if matcher.stopped:  # nothing may follow a complete grammar
            out.refused_at, out.error = i, "the grammar was already complete"
            return out
        out.masks.append(matcher.allowed())
        if not matcher.consume(token):
            out.refused_at, out.error = i, matcher.error
            return out
    out.stopped, out.accepting = matcher.stopped, matcher.accepting
    return out


def check_output(
    constraint: StructuredOutputsParams, text: str, sent_schema: dict | None = None
) -> str | None:
    """Why `text` does not satisfy the constraint, by checkers that are not llguidance (a
    grammar is the exception: see check_grammar_output); None when it does. A JSON schema is
    `sent_schema`, the schema as the request was written, where known."""
    kind = constraint.kind
    if kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except ValueError as err:
            return f"not JSON: {err}"
        if kind == "json_object":
            return (
                None if isinstance(value, dict) else f"JSON {type(value).__name__}, not an object"
            )
        try:
            schema = json.loads(constraint.json) if sent_schema is None else sent_schema
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as err:
            return f"fails its schema: {err.message}"
        return None
    if kind == "regex":
        return None if re.fullmatch(constraint.regex, text) else "does not fullmatch its regex"
    if kind == "choice":
        return None if text in constraint.choice else f"is none of {len(constraint.choice)} choices"
    return None  # a grammar: re-parsed by a fresh matcher (check_grammar_output)


def check_structured(
    spec,
    sample: int,
    ref: list[StepRecord],
    cand: list[StepRecord],
    completion,
    grammars: ReferenceGrammars,
    stop_ids: frozenset[int],
) -> tuple[list[Failure], list[torch.Tensor]]:
    """One constrained sample: its drawn tokens walked by the verifier's matcher, its end and
    (finished with "stop") its text checked. Returns the failures and the masks of the walk
    (for the sampling oracle: each draw against the masked distribution)."""
    params = spec.params.for_sample(sample)
    constraint = params.structured_outputs
    tokens = [r.chosen_token for r in cand]
    steps = walk(grammars, constraint, tokens)
    context = RequestContext(
        params, None, None if completion is None else completion.finish_reason, tuple(stop_ids)
    )
    if steps.refused_at is not None:
        at = steps.refused_at
        note = grammar_note(steps.masks[at], False) if at < len(steps.masks) else None
        message = f"drew token {tokens[at]} at step {at}, outside its grammar ({steps.error})"
        return [_failure(cand[at], _ref(ref, at), context, message, {"allowed_next": note})], []
    failures = []
    last = cand[-1] if cand else None
    end = {"allowed_next": {"stopped": steps.stopped, "accepting": steps.accepting}}
    if completion is not None and completion.finish_reason == "error":
        message = "ended with an error although every token it drew is in its grammar"
        failures.append(_failure(last, _ref(ref, len(cand) - 1), context, message, end))
    elif (
        completion is not None
        and completion.finish_reason == "stop"
        and not _cut(completion.token_ids, params, stop_ids)
    ):
        output = list(completion.token_ids)
        if output and output[-1] in stop_ids:
            output = output[:-1]
        text = grammars.text(output)
        problem = check_output(constraint, text, spec.sent_schema)
        if problem is None and constraint.kind == "grammar" and not steps.accepting:
            problem = "its grammar does not accept it"
        if problem is not None:
            message = f"output {text[:80]!r} {problem}"
            extra = {**end, "text": text[:200]}
            failures.append(_failure(last, _ref(ref, len(cand) - 1), context, message, extra))
    return failures, steps.masks


def _cut(output: list[int], params, stop_ids: frozenset[int]) -> bool:
    """The output ended on one of the request's own stop_token_ids (not EOS): a stop the user
    asked for, wherever the grammar was, so its text need not be complete."""
    eos = stop_ids - set(params.stop_token_ids)
    return bool(output) and output[-1] in params.stop_token_ids and output[-1] not in eos


def _ref(ref: list[StepRecord], step: int) -> StepRecord | None:
    return ref[step] if 0 <= step < len(ref) else (ref[-1] if ref else None)


def _failure(
    cand: StepRecord | None,
    ref: StepRecord | None,
    context: RequestContext,
    message: str,
    extra: dict | None = None,
) -> Failure:
    attribution = structured_attribution(ref, cand, context, message, extra)
    sample_id = "" if cand is None else cand.request_id
    step = -1 if cand is None else cand.step
    div = Divergence(sample_id, step, "structured", message, ref, cand, None, attribution)
    return Failure("structured", f"{sample_id}: {message}", sample_id or None, div)
