"""One answer of the server, reduced to what the audit compares: the output as token ids, token
strings or characters (whatever the server gives), each token's logprob and top-k, usage, timing.
Parses OpenAI completions and chat-completions bodies (and their stream chunks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

END = "<end>"  # the token shown where one output stopped and the other went on


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
            "ttft_s": self.ttft_s,
            "latency_s": round(self.latency_s, 6),
        }


def parse_body(body: dict[str, Any], chat: bool) -> Completion:
    """A non-streamed completions / chat-completions response body."""
    choice = (body.get("choices") or [{}])[0]
    if chat:
        text = ((choice.get("message") or {}).get("content")) or ""
        tokens, lps, top = _chat_logprobs(choice.get("logprobs"))
    else:
        text = choice.get("text") or ""
        tokens, lps, top = _completion_logprobs(choice.get("logprobs"))
    out = Completion(text, choice.get("finish_reason"), _ids(choice.get("token_ids")))
    out.tokens, out.logprobs, out.top = tokens, lps, top
    out.prompt_tokens, out.cached_tokens = usage_counts(body.get("usage"))
    return out


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


def _completion_logprobs(lp: Any) -> tuple[list[str] | None, list[float] | None, list | None]:
    if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
        return None, None, None
    top = lp.get("top_logprobs")
    top = [dict(t or {}) for t in top] if isinstance(top, list) else None
    return list(lp["tokens"]), _floats(lp.get("token_logprobs")), top


def _chat_logprobs(lp: Any) -> tuple[list[str] | None, list[float] | None, list | None]:
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list):
        return None, None, None
    tokens = [str(e.get("token")) for e in content]
    lps = _floats([e.get("logprob") for e in content])
    top = [
        {str(t.get("token")): t.get("logprob") for t in e.get("top_logprobs") or []}
        for e in content
    ]
    return tokens, lps, top


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
    ids = _ids(choice.get("token_ids"))
    if ids is not None:
        out.token_ids = (out.token_ids or []) + ids
    parse = _chat_logprobs if chat else _completion_logprobs
    tokens, lps, top = parse(choice.get("logprobs"))
    if tokens is not None:
        out.tokens = (out.tokens or []) + tokens
        out.logprobs = (out.logprobs or []) + (lps or [])
        out.top = (out.top or []) + (top or [])
    if choice.get("finish_reason"):
        out.finish_reason = choice["finish_reason"]
