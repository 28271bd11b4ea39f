"""Every field of a response against what the oracles expect, each mismatch a Failure with the
attribution class of what it is about:

  text, finish_reason, stop                       -> server_text
  token ids, logprobs, top logprobs, text_offset  -> server_logprobs
  cached tokens (namespace reuse)                 -> server_tenancy (more than its own namespace
                                                     could give: reuse across namespaces), or
                                                     server_admin (explained within its own
                                                     namespace once caching switches were used:
                                                     a switch missed or hit another namespace)
  status, envelope, stream framing, usage counts  -> server_protocol"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpage.verify.checks import Failure, finding
from kvpage.verify.stack.expect import Expected
from kvpage.verify.stack.responses import GotChoice, GotResponse
from kvpage.verify.stack.text_oracle import UNKNOWN, ExpectedChoice, TokenEntry

# Logprobs are compared within the request's logit tolerance (Expected.atol: the gate's dtype
# rule, diff.logit_atol): a logprob is its logit less the row's logsumexp, which moves no more
# than the logits do.


@dataclass(frozen=True, slots=True)
class Where:
    """Which request and how it was asked for, for every failure's fields."""

    request: str
    stream: bool
    model: str
    switches: str  # the caching switches when it ran

    def fields(self, choice: int | None, name: str, expected, actual) -> dict:
        return {
            "request": self.request,
            "choice": choice if choice is not None else "-",
            "field": name,
            "expected": _short(expected),
            "actual": _short(actual),
            "stream": self.stream,
        }


def _short(value) -> object:
    text = repr(value)
    return value if len(text) <= 300 else text[:300] + "…"


def failure(where: Where, cls: str, reason: str, fields: dict) -> Failure:
    div = finding("server", cls, reason, fields, where.request)
    return Failure("server", f"{where.request}: {reason}", where.request, div)


def compare(exp: Expected, got: GotResponse, where: Where) -> list[Failure]:
    if got.status != 200:
        f = where.fields(None, "status", 200, got.status)
        return [failure(where, "server_protocol", f"status {got.status}: {got.body}", f)]
    out = _framing(exp, got, where)
    for ec in exp.choices:
        gc = got.choices.get(ec.index)
        if gc is None:
            f = where.fields(ec.index, "choices", ec.index, sorted(got.choices))
            out.append(failure(where, "server_protocol", f"choice {ec.index} missing", f))
            continue
        out += _choice(exp, ec, gc, where)
    return out + _usage(exp, got, where)


def _framing(exp: Expected, got: GotResponse, where: Where) -> list[Failure]:
    out = [
        failure(where, "server_protocol", problem, where.fields(None, "framing", "", problem))
        for problem in got.framing
    ]
    body = got.body or {}
    chat, stream = exp.request.chat, exp.request.stream
    want = ("chat.completion" + (".chunk" if stream else "")) if chat else "text_completion"
    prefix = "chatcmpl-" if chat else "cmpl-"
    shape = {"object": want, "model": where.model, "id": prefix}
    have = {
        "object": body.get("object"),
        "model": body.get("model"),
        "id": str(body.get("id", ""))[: len(prefix)],
    }
    if have != shape:
        f = where.fields(None, "envelope", shape, have)
        out.append(failure(where, "server_protocol", "the response envelope is wrong", f))
    extra = sorted(set(got.choices) - {c.index for c in exp.choices})
    if extra:
        f = where.fields(None, "choices", len(exp.choices), extra)
        out.append(failure(where, "server_protocol", "choices nobody asked for", f))
    return out


def _choice(exp: Expected, ec: ExpectedChoice, gc: GotChoice, where: Where) -> list[Failure]:
    text_fields = {"stop": exp.stops, "token_ids": ec.token_ids}
    text_ok = gc.text == ec.text if ec.stable is None else gc.text.startswith(ec.text[: ec.stable])
    finish_ok = gc.finish_reason == ec.finish_reason or (
        not ec.tokens_exact and gc.finish_reason == "stop"
    )
    for name, want, have, ok in (
        ("text", ec.text, gc.text, text_ok),
        ("finish_reason", ec.finish_reason, gc.finish_reason, finish_ok),
    ):
        if not ok:
            f = where.fields(ec.index, name, want, have) | text_fields
            if name == "text" and ec.stable is not None:
                f["stable"] = ec.text[: ec.stable]  # what must start the text
            return [failure(where, "server_text", f"choice {ec.index}: {name} differs", f)]
    if where.stream and gc.finishes != 1:
        f = where.fields(ec.index, "finish_reason chunks", 1, gc.finishes)
        return [failure(where, "server_protocol", "a choice must finish exactly once", f)]
    return _per_token(exp, ec, gc, where)


def _per_token(exp: Expected, ec: ExpectedChoice, gc: GotChoice, where: Where) -> list[Failure]:
    req = exp.request

    def fail(name: str, want, have) -> list[Failure]:
        f = where.fields(ec.index, name, want, have) | {"token_ids": ec.token_ids}
        f["stop"] = exp.stops
        return [failure(where, "server_logprobs", f"choice {ec.index}: {name} differs", f)]

    want_ids = ec.token_ids if req.return_token_ids else None
    ended_early = (  # a stop string past the stable text may have ended it sooner (unjudged)
        not ec.tokens_exact
        and gc.token_ids is not None
        and want_ids is not None
        and want_ids[: len(gc.token_ids)] == gc.token_ids
    )
    if gc.token_ids != want_ids and not ended_early:
        return fail("token_ids", want_ids, gc.token_ids)
    if ec.entries is None or gc.entries is None:
        return (
            []
            if ec.entries is None and gc.entries is None
            else fail("logprobs", ec.entries is not None, gc.entries is not None)
        )
    shorter = not ec.tokens_exact and len(gc.entries) < len(ec.entries)
    if len(ec.entries) != len(gc.entries) and not shorter:
        return fail("logprobs length", len(ec.entries), len(gc.entries))
    for i, (want, have) in enumerate(zip(ec.entries, gc.entries, strict=False)):
        problem = _entry(want, have, req.chat, exp.atol)
        if problem is not None:
            name, w, h = problem
            return fail(f"logprobs[{i}].{name}", w, h)
    return []


def _entry(
    want: TokenEntry, have: dict, chat: bool, atol: float
) -> tuple[str, object, object] | None:
    spelled = want.text if chat else want.key
    if have["token"] != spelled:
        return "token", spelled, have["token"]
    if want.logprob is None or have["logprob"] is None:  # an echoed prompt's first token
        if (want.logprob, want.top) != (have["logprob"], have["top"]):
            return "logprob", (want.logprob, want.top), (have["logprob"], have["top"])
        return (
            None
            if chat or have["offset"] == want.offset
            else ("text_offset", want.offset, have["offset"])
        )
    if not math.isclose(have["logprob"], want.logprob, abs_tol=atol):
        return "logprob", want.logprob, have["logprob"]
    if not chat and want.offset_judged and have["offset"] != want.offset:
        return "text_offset", want.offset, have["offset"]
    if chat and want.piece is not UNKNOWN and have["bytes"] != _bytes(want.piece):
        return "bytes", _bytes(want.piece), have["bytes"]
    return _top(want, have, chat, atol)


def _bytes(piece) -> list[int] | None:
    return list(piece) if piece else None


def _top(
    want: TokenEntry, have: dict, chat: bool, atol: float
) -> tuple[str, object, object] | None:
    # Completions (OpenAI, vLLM) list the chosen token too when it is outside the top k; chat's
    # top_logprobs are the top k alone.
    top = want.top if chat else want.keyed_top
    values = {name: (value, want.top_bytes.get(name)) for name, value in top.items()}
    if set(top) != set(have["top"]):
        if not _tied_top(want, have, chat, atol):
            return "top_logprobs", sorted(top), sorted(have["top"])
        values = dict(want.band) if chat else {**want.keyed_band, want.key: (want.logprob, None)}
    for name in have["top"]:
        value, alt = values[name]
        if not math.isclose(have["top"][name], value, abs_tol=atol):
            return f"top_logprobs[{name}]", value, have["top"][name]
        if chat and alt is not UNKNOWN and have["top_bytes"][name] != _bytes(alt):
            return f"top_logprobs[{name}].bytes", _bytes(alt), have["top_bytes"][name]
    return None


def _tied_top(want: TokenEntry, have: dict, chat: bool, atol: float) -> bool:
    """Whether another top k than the reference's is one of its tie: every token kept is in the
    band (within `atol` below the reference's k-th) and none left out scores more than `atol`
    above one kept (drift of `atol` on each logit can swap such a pair, and no other)."""
    k, names = len(want.top), set(have["top"])
    band = want.band if chat else want.keyed_band
    if not chat:  # the chosen token is listed too when it is outside the top k
        if want.key not in names:
            return False
        names = names - {want.key} if len(names) == k + 1 else names
    if len(names) != k or not names <= set(band):
        return False
    lowest_kept = min(band[n][0] for n in names)
    left = [v for n, (v, _) in band.items() if n not in names]
    return not left or max(left) - lowest_kept <= atol


def _completion_tokens(exp: Expected, got: GotResponse) -> tuple[int, int]:
    """The completion tokens usage may count. A choice whose tokens are not exact (a stop
    string may have matched past its stable text, ExpectedChoice.tokens_exact) counts what its
    own token ids or logprobs say it returned (checked there as a prefix of the reference's),
    or, where the response lists neither, anything from one token to the reference's all."""
    low = high = 0
    for ec in exp.choices:
        n = len(ec.token_ids) - ec.prefix_tokens
        gc = got.choices.get(ec.index)
        listed = None if gc is None else gc.token_ids if gc.token_ids is not None else gc.entries
        if ec.tokens_exact:
            low, high = low + n, high + n
        elif listed is not None and len(listed) - ec.prefix_tokens <= n:
            low, high = low + len(listed) - ec.prefix_tokens, high + len(listed) - ec.prefix_tokens
        else:
            low, high = low + min(n, 1), high + n
    return low, high


def _usage(exp: Expected, got: GotResponse, where: Where) -> list[Failure]:
    req = exp.request
    if req.stream and not req.include_usage:
        return (
            []
            if got.usage is None
            else [
                failure(
                    where,
                    "server_protocol",
                    "usage without include_usage",
                    where.fields(None, "usage", None, got.usage),
                )
            ]
        )
    usage = got.usage or {}
    low, high = _completion_tokens(exp, got)
    have = {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    completion = have["completion_tokens"]
    ok = (
        have["prompt_tokens"] == exp.prompt_tokens
        and isinstance(completion, int)
        and low <= completion <= high
        and have["total_tokens"] == exp.prompt_tokens + completion
    )
    if not ok:
        span = low if low == high else f"{low}..{high}"
        counts = {
            "prompt_tokens": exp.prompt_tokens,
            "completion_tokens": span,
            "total_tokens": exp.prompt_tokens + low if low == high else "prompt + completion",
        }
        f = where.fields(None, "usage", counts, have)
        return [failure(where, "server_protocol", "usage counts differ", f)]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached == exp.cached_tokens:
        return []
    # Prompt logprobs hit only blocks whose rows the engine's row store kept (not modelled here;
    # the scenarios give such prompts no block in common with any other): the namespace model
    # bounds them. Their values are checked row by row.
    rows = exp.request.echo and exp.request.logprobs is not None
    if rows and cached is not None and 0 <= cached <= exp.cached_tokens:
        return []
    f = where.fields(None, "cached_tokens", exp.cached_tokens, cached)
    f |= {"namespace": repr(exp.namespace), "prompt_tokens": exp.prompt_tokens}
    if exp.switched and cached is not None and cached <= exp.unswitched_cached:
        f["switches"] = where.switches
        reason = "cached tokens follow no switch state (a switch missed, or hit another namespace)"
        return [failure(where, "server_admin", reason, f)]
    return [failure(where, "server_tenancy", "cached tokens differ from the namespace model", f)]
