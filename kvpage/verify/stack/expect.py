"""What each generated request must get back, from the reference and the oracles alone: the
choices (text oracle, the served model's tokenizer read independently), the usage, and the
cached-token count (a per-namespace model of the prefix cache: block-granular reuse of earlier
prompts in the same namespace, none across). Prompts are the oracle tokenizer's encoding (chat:
the served model's own template through transformers, the built-in one where it has none); echo
is the prompt's text and the reference's prompt logprobs before each choice; a list of prompts
is choice i * n + j for sample j of prompt i."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from kvpage.reference.generator import ReferenceOutput, generate, prompt_logprobs
from kvpage.sampling_params import SamplingParams
from kvpage.verify.diff import HALF_DTYPES, logit_atol
from kvpage.verify.stack.scenario import GenRequest, common_prefix, pick_stops
from kvpage.verify.stack.text_oracle import (
    ExpectedChoice,
    choice_texts,
    expected_choice,
    prompt_entries,
)
from kvpage.verify.stack.ties import EngineDraw, follow_ties

Namespace = tuple[str, str | None]  # ("tenant", name) or ("salt", cache salt or None)


def chat_prompt(message: str) -> str:
    """The built-in models' documented chat template, for one user message."""
    return f"<|user|>\n{message}\n<|assistant|>\n"


@dataclass(slots=True)
class CacheModel:
    """Which prompts' full blocks each namespace holds. The pool is sized so nothing is ever
    evicted; while caching is off (everywhere, or for the namespace) a request neither hits
    nor publishes."""

    block_size: int
    published: dict[Namespace, list[tuple[int, ...]]] = field(default_factory=dict)
    sent: dict[Namespace, list[tuple[int, ...]]] = field(default_factory=dict)  # switches or not
    caching: bool = True
    off: set[Namespace] = field(default_factory=set)
    switched: bool = False  # some caching switch has been off in this app

    def enabled(self, ns: Namespace) -> bool:
        return self.caching and ns not in self.off

    def switch(self, ns: Namespace | None, enabled: bool) -> None:
        """`ns` None: the global switch."""
        self.switched |= not enabled
        if ns is None:
            self.caching = enabled
        else:
            (self.off.discard if enabled else self.off.add)(ns)

    def hit(self, ns: Namespace, prompt: tuple[int, ...], held=None) -> int:
        """Cached tokens if caching were on: the longest shared run of whole blocks with an
        earlier prompt of the namespace, leaving at least one prompt token to compute."""
        bs = self.block_size
        held = self.published if held is None else held
        best = max((common_prefix(prompt, p) for p in held.get(ns, [])), default=0)
        return min(best // bs, (len(prompt) - 1) // bs) * bs

    def admit(self, ns: Namespace, prompt: tuple[int, ...]) -> int:
        self.sent.setdefault(ns, []).append(prompt)
        if not self.enabled(ns):
            return 0
        hit = self.hit(ns, prompt)
        self.published.setdefault(ns, []).append(prompt)
        return hit


@dataclass(frozen=True, slots=True)
class Expected:
    request: GenRequest
    prompt_ids: tuple[int, ...]  # the first prompt's (`prompts`: every prompt of the request)
    params: SamplingParams
    stops: list[str]
    choices: list[ExpectedChoice]
    namespace: Namespace
    cached_tokens: int
    unswitched_cached: int  # what it would be had no caching switch ever been off
    switched: bool  # some caching switch has been off in this app, before or now
    atol: float = 0.0  # the logit tolerance (diff.logit_atol): logprobs, top-k ties, ties
    prompts: tuple[tuple[int, ...], ...] = ()

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) - c.prefix_tokens for c in self.choices)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts or (self.prompt_ids,))


@dataclass(slots=True)
class References:
    """The contiguous reference per (prompt, sample parameters), computed once."""

    model: object
    memo: dict[tuple, ReferenceOutput] = field(default_factory=dict)

    def get(self, prompt: tuple[int, ...], params: SamplingParams) -> ReferenceOutput:
        key = (prompt, params)
        if key not in self.memo:
            self.memo[key] = generate(self.model, list(prompt), params)
        return self.memo[key]

    @property
    def ties(self) -> bool:
        """16-bit models: a numeric tie may send the server down another path (the gate's
        rule, diff.is_numeric_tie; the suite's pool is in the model's own dtype)."""
        return self.model.dtype in HALF_DTYPES

    def atol(self, samples: list[ReferenceOutput]) -> float:
        """The logit tolerance of the request (diff.logit_atol, KV in the model's dtype), for
        logits of the size of the reference's largest over its samples' steps."""
        peaks = [float(x.abs().max()) for s in samples for x in s.step_logits]
        return logit_atol("auto", self.model.dtype, max([1.0, *peaks]))


def prompt_ids(text_model, req: GenRequest, prompt=None) -> tuple[int, ...]:
    """The oracle tokenizer's ids of `prompt` (default: the request's first): chat through the
    model's own template where it has one (which spells its special tokens itself), else the
    built-in template encoded as text."""
    prompt = req.prompt if prompt is None else prompt
    if req.chat:
        messages = [{"role": "user", "content": prompt}]
        if text_model.has_template:
            return tuple(text_model.chat(messages))
        return tuple(text_model.encode(chat_prompt(prompt)))
    if isinstance(prompt, str):
        return tuple(text_model.encode(prompt))
    return tuple(prompt)


def namespace_of(req: GenRequest) -> Namespace:
    return ("tenant", req.tenant) if req.tenant is not None else ("salt", req.cache_salt)


def expect(
    req: GenRequest, text_model, refs: References, cache: CacheModel, rng: random.Random
) -> Expected:
    all_ids = tuple(prompt_ids(text_model, req, p) for p in req.prompts)
    ids = all_ids[0]
    params = _params(req, ids, refs)
    per_prompt = [
        [refs.get(p, _sample_params(req, params, i)) for i in range(req.n)] for p in all_ids
    ]
    samples = [s for group in per_prompt for s in group]
    first = samples[0].token_ids if req.max_tokens else []
    text = choice_texts(text_model, list(ids), first)[-1]
    stops = pick_stops(rng, text, req.stop_picks)
    atol = refs.atol(samples)
    choices = [
        _choice(text_model, refs, req, params, p * req.n + i, s, stops, atol, all_ids[p])
        for p, group in enumerate(per_prompt)
        for i, s in enumerate(group)
    ]
    ns = namespace_of(req)
    unswitched = sum(cache.hit(ns, p, cache.sent) for p in all_ids)
    cached = sum(cache.admit(ns, p) for p in all_ids)
    return Expected(
        req, ids, params, stops, choices, ns, cached, unswitched, cache.switched, atol, all_ids
    )


def _sample_params(req: GenRequest, params: SamplingParams, i: int) -> SamplingParams:
    return params.for_sample(i) if req.n > 1 else params


def _choice(
    text_model, refs, req, params, index: int, sample: ReferenceOutput, stops, atol, prompt
) -> ExpectedChoice:
    if req.max_tokens == 0:  # echo alone: the token the engine drew is dropped
        choice = ExpectedChoice(
            index, "", "length", [], [] if params.logprobs is not None else None, None
        )
    else:
        choice = expected_choice(
            text_model,
            index,
            sample.token_ids,
            sample.step_logits,
            sample.finish_reason,
            stops,
            params.logprobs,
            req.stream,
            atol,
            prompt,
        )
    return _echoed(text_model, refs, req, params, choice, prompt, atol) if req.echo else choice


def _echoed(text_model, refs, req, params, choice: ExpectedChoice, prompt, atol):
    """The choice after its echoed prompt: text, tokens, logprobs (the reference's prompt rows,
    with a band's worth of entries past the k), offsets counted from the prompt's text."""
    k = params.logprobs
    vocab = refs.model.config.vocab_size
    rows = prompt_logprobs(refs.model, list(prompt), min(vocab, (k or 0) + 16))
    text, entries, stable = prompt_entries(text_model, list(prompt), rows, k or 0, atol)
    if stable is None and choice.stable is not None:
        stable = len(text) + choice.stable
    completion = choice.entries
    if k is None:
        all_entries = None
    else:
        shift = len(text)
        all_entries = entries + [replace(e, offset=e.offset + shift) for e in (completion or [])]
    return replace(
        choice,
        text=text + choice.text,
        token_ids=list(prompt) + choice.token_ids,
        entries=all_entries,
        stable=stable,
        prefix_tokens=len(prompt),
    )


def follow(
    exp: Expected, draws: dict[int, list[EngineDraw]] | None, refs: References, tokenizer
) -> Expected:
    """`exp` with each choice whose engine tokens left the reference's at a numeric tie
    (16-bit models) expected along the reference forced at those ties (kvpage.verify.stack.ties);
    every other choice, and every other field, as it was (`exp` itself when none is)."""
    if not draws or not refs.ties or len(exp.request.prompts) > 1 or not exp.request.max_tokens:
        return exp
    choices = list(exp.choices)
    for i, choice in enumerate(exp.choices):
        params = _sample_params(exp.request, exp.params, i)
        engine = draws.get(i, [])
        tokens = choice.token_ids[choice.prefix_tokens :]
        if [d.token for d in engine[: len(tokens)]] == tokens[: len(engine)]:
            continue  # no token differs: nothing to follow
        path = follow_ties(refs.model, list(exp.prompt_ids), params, engine, exp.atol)
        if path is not None:
            choices[i] = _choice(
                tokenizer, refs, exp.request, exp.params, i, path, exp.stops, exp.atol,
                exp.prompt_ids,
            )  # fmt: skip
    return exp if choices == exp.choices else replace(exp, choices=choices)


def _params(req: GenRequest, ids: tuple[int, ...], refs: References) -> SamplingParams:
    params = SamplingParams(
        temperature=req.temperature,
        max_tokens=max(req.max_tokens, 1),  # 0 (echo alone): the server draws one, dropped
        seed=req.seed,
        logprobs=req.logprobs,
        n=req.n,
    )
    if req.stop_token_at is None:
        return params
    free = refs.get(ids, params.for_sample(0) if req.n > 1 else params).token_ids
    return replace(params, stop_token_ids=(free[min(req.stop_token_at, len(free) - 1)],))
