"""One answer of the server, reduced to what the audit compares: the output as token ids, token
strings or characters (whatever the server gives), each token's logprob and top-k, usage, timing.
Parses OpenAI completions and chat-completions bodies (and their stream chunks), and the logprob
shapes real servers put in them, whichever endpoint they answer on:

- completions shape `{"tokens", "token_logprobs", "top_logprobs": [{token: lp}]}`: OpenAI's legacy
  completions, vLLM, SGLang (whose `top_logprobs` entries may be null), kvpage;
- chat shape `{"content": [{"token", "logprob", "top_logprobs": [{"token", "logprob"}]}]}`: chat
  completions everywhere (vLLM, `transformers serve`), and llama.cpp's server on /v1/completions
  too, whose entries also carry the token `id`.

Output token ids come from `choices[].token_ids` (vLLM's `return_token_ids`), else the ids in
chat-shaped logprob entries (llama.cpp). Token strings spelled `token_id:N` (kvpage, vLLM for
undecodable tokens) stay strings: a server spells only some tokens so, and an answer compared as
ids against one compared as strings would always differ."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

END = "<end>"  # the token shown where one output stopped and the other went on
COMPLETIONS_SHAPE = "choices[].logprobs.top_logprobs (completions shape)"
CHAT_SHAPE = "choices[].logprobs.content[].top_logprobs (chat shape)"
IDS_FIELD = "choices[].token_ids"
IDS_IN_LOGPROBS = "choices[].logprobs.content[].id"


def token_key(token_id: int) -> str:
    """A token spelled by its id, as vLLM's return_tokens_as_token_ids spells it."""
    return f"token_id:{token_id}"


@dataclass(slots=True)
class Completion:
    text: str
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # when the server returns them (return_token_ids)
    tokens: list[str] | None = None  # token strings, from logprobs
    logprobs: list[float] | None = None  # the chosen token's, per token
    top: list[dict[str, float]] | None = None  # top-k per token
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    ttft_s: float | None = None  # time to the first output chunk (streamed requests only)
    latency_s: float = 0.0
    shared_bound: int | None = None  # most prompt tokens the audit had shared (accounting.py)
    logprobs_field: str | None = None  # where the logprobs were found (a *_SHAPE above)
    prompt_ids: tuple[int, ...] | None = None  # the prompt, when sent as ids (for a reference)
    ids_field: str | None = None  # where the output token ids were found

    @property
    def phantom(self) -> bool:
        """Served more cached tokens than the audit could have put in its namespace."""
        bound, cached = self.shared_bound, self.cached_tokens
        return bool(cached) and bound is not None and cached > bound

    def units(self) -> tuple[str, list]:
        """The output as the finest comparable sequence: ids, else token strings, else chars."""
        if self.token_ids is not None:
            return "token", list(self.token_ids)
        if self.tokens is not None:
            return "token", list(self.tokens)
        return "char", list(self.text)

    def top_at(self, i: int) -> list[tuple[str, float]]:
        """Top-k at output position i, most likely first (empty when not reported)."""
        if self.top is None or i >= len(self.top):
            return []
        return sorted(self.top[i].items(), key=lambda kv: -kv[1])

    def gap_at(self, i: int) -> float | None:
        """Logprob gap between the two most likely tokens at position i."""
        top = self.top_at(i)
        return top[0][1] - top[1][1] if len(top) >= 2 else None

    def token_text(self, i: int) -> str:
        kind, units = self.units()
        if i >= len(units):
            return END
        if self.tokens is not None and i < len(self.tokens):
            return self.tokens[i]
        return str(units[i])

    def summary(self) -> dict[str, Any]:
        """For report.json: enough to see what came back, never the whole top-k table."""
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "shared_bound": self.shared_bound,
            "ttft_s": self.ttft_s,
            "latency_s": round(self.latency_s, 6),
        }


def parse_body(body: dict[str, Any], chat: bool) -> Completion:
    """A non-streamed completions / chat-completions response body."""
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    text = (message.get("content") if chat else choice.get("text")) or ""
    out = Completion(text, choice.get("finish_reason"))
    _fill(out, choice)
    out.prompt_tokens, out.cached_tokens = usage_counts(body.get("usage"))
    return out


@dataclass(slots=True)
class Logprobs:
    """One choice's logprobs, whatever their shape."""

    tokens: list[str]
    lps: list[float]
    top: list[dict[str, float]]
    ids: list[int] | None
    shape: str


def _fill(out: Completion, choice: dict[str, Any]) -> None:
    lp = parse_logprobs(choice.get("logprobs"))
    if lp is not None:
        out.tokens, out.logprobs, out.top = lp.tokens, lp.lps, lp.top
        out.logprobs_field = lp.shape
    ids = _ids(choice.get("token_ids"))
    if ids is not None:
        out.token_ids, out.ids_field = ids, IDS_FIELD
    elif lp is not None and lp.ids is not None:
        out.token_ids, out.ids_field = lp.ids, IDS_IN_LOGPROBS


def parse_logprobs(lp: Any) -> Logprobs | None:
    if not isinstance(lp, dict):
        return None
    if isinstance(lp.get("content"), list):
        return _chat_shape(lp["content"])
    if isinstance(lp.get("tokens"), list):
        return _completions_shape(lp)
    return None


def usage_counts(usage: Any) -> tuple[int | None, int | None]:
    """(prompt_tokens, cached_tokens); cached is None unless the server reports it."""
    if not isinstance(usage, dict):
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = usage.get("prompt_tokens")
    return (
        prompt if isinstance(prompt, int) else None,
        cached if isinstance(cached, int) else None,
    )


def chunk_has_output(chunk: dict[str, Any]) -> bool:
    """A stream chunk that carries generated output (not a role-only or usage-only chunk)."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or choice.get("token_ids"):
            return True
        if choice.get("logprobs") or choice.get("finish_reason"):
            return True
    return False


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    return None


def _completions_shape(lp: dict[str, Any]) -> Logprobs:
    tokens = [str(t) for t in lp["tokens"]]
    top = lp.get("top_logprobs")
    top = [_top_entries(t) for t in top] if isinstance(top, list) else []
    lps = _floats(lp.get("token_logprobs")) or []
    return Logprobs(tokens, lps, top, None, COMPLETIONS_SHAPE)


def _chat_shape(content: list[Any]) -> Logprobs:
    """Entries with ids (llama.cpp) are keyed by id, spelled `token_id:N`: byte-fallback pieces
    of different tokens often decode to one string, and a top-k keyed by strings would then
    merge them into false ties."""
    entries = [e for e in content if isinstance(e, dict)]
    ids = [e.get("id") for e in entries]
    has_ids = bool(ids) and all(isinstance(i, int) for i in ids)
    by_id = has_ids and all(_top_ids(e.get("top_logprobs")) for e in entries)
    tokens = [token_key(e["id"]) if by_id else str(e.get("token")) for e in entries]
    lps = _floats([e.get("logprob") for e in entries]) or []
    top = [_top_entries(e.get("top_logprobs"), by_id=by_id) for e in entries]
    return Logprobs(tokens, lps, top, ids if has_ids else None, CHAT_SHAPE)


def _top_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("id"), int) for t in value
    )


def _top_entries(value: Any, by_id: bool = False) -> dict[str, float]:
    """A position's top-k: `{token: lp}` (completions shape), `[{"token", "logprob"}]` (chat
    shape; `by_id`: keyed `token_id:N`), or null (SGLang, where it has none)."""
    if isinstance(value, dict):
        return {str(k): float(v) for k, v in value.items() if isinstance(v, (int, float))}
    if isinstance(value, list):
        return {
            token_key(t["id"]) if by_id else str(t.get("token")): float(t["logprob"])
            for t in value
            if isinstance(t, dict) and isinstance(t.get("logprob"), (int, float))
        }
    return {}


def _floats(values: Any) -> list[float] | None:
    if not isinstance(values, list):
        return None
    return [float(v) if isinstance(v, (int, float)) else float("nan") for v in values]


@dataclass(slots=True)
class StreamTiming:
    """What a streamed request measured: time to first output, and usage if the last chunk had it."""

    ttft_s: float
    latency_s: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)


def merge_chunks(chunks: list[dict[str, Any]], chat: bool) -> Completion:
    """A streamed answer put back together: text, token ids and logprobs in order."""
    out = Completion("")
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            _merge_choice(out, choice, chat)
    prompt, cached = None, None
    for chunk in chunks:
        if chunk.get("usage"):
            prompt, cached = usage_counts(chunk["usage"])
    out.prompt_tokens, out.cached_tokens = prompt, cached
    return out


def _merge_choice(out: Completion, choice: dict[str, Any], chat: bool) -> None:
    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    out.text += piece or ""
    part = Completion("")
    _fill(part, choice)
    if part.token_ids is not None:
        out.token_ids = (out.token_ids or []) + part.token_ids
        out.ids_field = part.ids_field
    if part.tokens is not None:
        out.tokens = (out.tokens or []) + part.tokens
        out.logprobs = (out.logprobs or []) + (part.logprobs or [])
        out.top = (out.top or []) + (part.top or [])
        out.logprobs_field = part.logprobs_field
    if choice.get("finish_reason"):
        out.finish_reason = choice["finish_reason"]
