"""Structured outputs: constrained requests (JSON schema, regex, choice, json_object, a Lark
grammar) beside free ones in one batch, on tight pools preempting by recompute and by swap,
with n > 1 and shared prefixes. Every sample is diffed against the reference, which applies
each constraint through its own matcher (greedy constrained tokens must equal its tokens); every
draw is checked against the masked, renormalised distribution, and every output that ends with
"stop" by an independent checker (kvpage.verify.structured). The compile cache is checked
exactly: one compile per distinct constraint, a hit for every repeat, and two schemas with one
title are two grammars (a cache keyed by the name would hand the second the first's).

The schemas and patterns are bounded (integer ranges, enums, short patterns, few items) and
JSON has no free whitespace, so a random-weight model's output ends well within max_tokens."""

from __future__ import annotations

from dataclasses import replace

from kvpage.sampling_params import SamplingParams
from kvpage.structured_params import StructuredOutputsParams
from kvpage.verify.case import Case, RequestSpec, Tokens, forced_preemption_case, preempt_once_added

B = 8
MAX_TOKENS = 40

# Two schemas with one title and other content: a cache keyed by the name confuses them.
ITEM_IDS = {
    "title": "Item",
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["id", "tag"],
    "additionalProperties": False,
}
ITEM_NAMES = {
    "title": "Item",
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "ok"],
    "additionalProperties": False,
}
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}


def constraint(kind: str) -> StructuredOutputsParams:
    """The suite's constraints by name."""
    compact = {"disable_any_whitespace": True}
    return {
        "ids": StructuredOutputsParams(json=ITEM_IDS, **compact),
        "names": StructuredOutputsParams(json=ITEM_NAMES, **compact),
        "digits": StructuredOutputsParams(json=DIGITS, **compact),
        "object": StructuredOutputsParams(json_object=True, **compact),
        "regex": StructuredOutputsParams(regex=r"[a-f]{2,6}-[0-9]{1,3}"),
        "answer": StructuredOutputsParams(regex=r"(yes|no|maybe)[.!?]"),
        "choice": StructuredOutputsParams(choice=["alpha", "beta", "gamma", "delta"]),
        "grammar": StructuredOutputsParams(
            grammar='start: "<" item ("," item)? ">"\nitem: "x" | "yy" | "zzz"'
        ),
    }[kind]


def _greedy(kind: str | None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    so = None if kind is None else constraint(kind)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=so)


def _seeded(kind: str | None, seed: int, top_k: int = 5, top_p: float = 0.9) -> SamplingParams:
    so = None if kind is None else constraint(kind)
    return SamplingParams(
        temperature=0.8,
        top_k=top_k,
        top_p=top_p,
        max_tokens=MAX_TOKENS,
        seed=seed,
        structured_outputs=so,
    )


def structured_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=4343)
    cases = [_mixed_batch(t), _parallel(t)]
    cases += [_preempted(t, mode) for mode in ("recompute", "swap")]
    for case in cases:
        for spec in case.requests:
            spec.sent_schema = _sent_schema(spec.params.structured_outputs)
    return cases


def _sent_schema(constraint: StructuredOutputsParams | None) -> dict | None:
    """The suite's own schema a JSON constraint was made from (the checker's, not the
    normalized text the engine compiles)."""
    if constraint is None or constraint.kind != "json":
        return None
    compact = {"disable_any_whitespace": constraint.disable_any_whitespace}
    schemas = (ITEM_IDS, ITEM_NAMES, DIGITS)
    return next(s for s in schemas if StructuredOutputsParams(json=s, **compact) == constraint)


def compile_counters(specs: list[RequestSpec]) -> dict[str, int]:
    """The compile cache's exact counters after `specs`: one compile per distinct constraint
    (by content), a hit for every other constrained request (its samples share its matcher's
    grammar and compile nothing)."""
    digests = [s.params.structured_outputs.digest for s in specs if s.params.structured_outputs]
    distinct = len(set(digests))
    return {"grammar_compiles": distinct, "grammar_cache_hits": len(digests) - distinct}


def _mixed_batch(t: Tokens) -> Case:
    """Every kind of constraint, greedy and seeded (top-k and top-p after the mask), beside
    free rows in the same steps; a schema repeated (cache hits) and two schemas titled alike;
    a shared prefix whose second request hits the prefix cache and is masked from its first
    token."""
    shared = t.take(3 * B)
    kinds = ("ids", "names", "digits", "regex", "answer", "choice", "grammar", "object")
    # any object (json_object) is unbounded: a random model need not close it, so few tokens
    short = {"object": 12}
    specs = [
        RequestSpec(f"g.{k}", t.take(5 + i), _greedy(k, short.get(k, MAX_TOKENS)))
        for i, k in enumerate(kinds)
    ]
    specs += [
        RequestSpec(f"s.{k}", t.take(6 + i), _seeded(k, 4300 + i, top_k=3 + i))
        for i, k in enumerate(("ids", "names", "digits", "regex", "choice"))
    ]
    specs += [
        RequestSpec("free.greedy", t.take(9), _greedy(None, 24)),
        RequestSpec("free.seeded", t.take(10), _seeded(None, 4390)),
        RequestSpec("hit.first", shared + t.take(3), _greedy("ids")),
        RequestSpec("hit.second", shared + t.take(4), _greedy("ids"), arrive_step=3),
        RequestSpec("late.names", t.take(7), _seeded("names", 4391, top_k=-1), arrive_step=5),
    ]
    return Case(
        "structured",
        "mixed_batch",
        specs,
        dict(block_size=B, num_blocks=160, max_num_batched_tokens=96),
        expect_hit=("hit.second",),
        expect_counters=compile_counters(specs),
        check_sampling=True,
    )


def _parallel(t: Tokens) -> Case:
    """n = 3 of constrained requests, greedy-free (seeded, so each sample replays alone) and
    sharing one prompt: each sample must run its own copy of the matcher from the fork on."""
    prompt = t.take(13)
    specs = [
        RequestSpec("n3.ids", prompt, replace(_seeded("ids", 4310, top_k=-1, top_p=1.0), n=3)),
        RequestSpec("n3.regex", prompt, replace(_seeded("regex", 4320, top_k=8), n=3)),
        RequestSpec("n3.choice", t.take(9), replace(_seeded("choice", 4330, top_k=-1), n=3)),
        RequestSpec("n1.free", prompt, _seeded(None, 4340)),
    ]
    return Case(
        "structured",
        "parallel_n3",
        specs,
        dict(block_size=B, num_blocks=96),
        expect_counters=compile_counters(specs),
        check_sampling=True,
    )


def _preempted(t: Tokens, mode: str) -> Case:
    """Constrained requests preempted mid-output (forced, and by a pool too small for all):
    after a recompute the matcher must stand for the output again, after a swap it is kept."""
    kinds = ("ids", "names", "regex", None, "digits", "choice", "ids", None)
    specs = [
        RequestSpec(
            f"p{i}.{k or 'free'}",
            t.take(9 + 2 * i),
            _greedy(k) if i % 2 == 0 else _seeded(k, 4350 + i, top_k=-1),
            arrive_step=i // 3,
        )
        for i, k in enumerate(kinds)
    ]
    forced = [
        preempt_once_added(f"preempt {s.request_id}", s.request_id, 4 + i, 2, mode)
        for i, s in enumerate(specs[:3])
    ]
    counters = compile_counters(specs)
    return forced_preemption_case(
        "structured", f"preempted_{mode}", specs, forced, mode, (B, 20), 6,
        expect_counters=counters, check_sampling=True,
    )  # fmt: skip
