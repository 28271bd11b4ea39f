"""OpenAI response bodies and stream chunks for completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvpage.model.tokenizer import Tokenizer
from kvpage.server.generation import Delta, Generation, TokenLogprobs
from kvpage.server.protocol import usage


@dataclass(frozen=True, slots=True)
class Shape:
    """What the client asked the response to look like."""

    chat: bool
    request_id: str
    model: str
    num_logprobs: int | None  # top-k wanted per token (None: no logprobs)
    return_token_ids: bool
    created: int = 0
    include_usage: bool = False  # stream chunks carry `usage` (null until the last one)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def sse(body: dict[str, Any] | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


def new_shape(
    chat: bool, model: str, num_logprobs: int | None, token_ids: bool, include_usage: bool = False
) -> Shape:
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    return Shape(chat, request_id, model, num_logprobs, token_ids, created, include_usage)


def _envelope(shape: Shape, choices: list[dict], chunk: bool) -> dict[str, Any]:
    obj = shape.object + (".chunk" if chunk and shape.chat else "")
    return {
        "id": shape.request_id,
        "object": obj,
        "created": shape.created,
        "model": shape.model,
        "choices": choices,
    }


def final_body(shape: Shape, gen: Generation, tok: Tokenizer) -> dict[str, Any]:
    """One choice per sample, by index; usage counts the tokens of all of them."""
    choices = []
    for c in gen.choices:
        lps = c.logprobs if shape.num_logprobs is not None else None
        choices.append(
            _choice(shape, c.index, c.text.text, c.token_ids, lps, c.finish_reason, tok, False)
        )
    body = _envelope(shape, choices, chunk=False)
    body["usage"] = usage(len(gen.prompt_ids), gen.num_tokens, gen.cached_tokens)
    return body


def chunk_body(shape: Shape, delta: Delta, tok: Tokenizer) -> dict[str, Any]:
    choice = _choice(
        shape,
        delta.index,
        delta.text,
        delta.token_ids,
        delta.logprobs,
        delta.finish_reason,
        tok,
        True,
    )
    return _stream_envelope(shape, [choice])


def role_chunk(shape: Shape, index: int = 0) -> dict[str, Any]:
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    return _stream_envelope(shape, [choice])


def _stream_envelope(shape: Shape, choices: list[dict]) -> dict[str, Any]:
    """A chunk before the last: with include_usage, OpenAI sends `usage: null` on every one."""
    body = _envelope(shape, choices, chunk=True)
    if shape.include_usage:
        body["usage"] = None
    return body


def usage_chunk(shape: Shape, gen: Generation) -> dict[str, Any]:
    body = _envelope(shape, [], chunk=True)
    body["usage"] = usage(len(gen.prompt_ids), gen.num_tokens, gen.cached_tokens)
    return body


def _choice(shape, index, text, token_ids, logprobs, finish_reason, tok, chunk) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index}
    if shape.chat:
        choice["delta" if chunk else "message"] = (
            {"content": text} if chunk else {"role": "assistant", "content": text}
        )
    else:
        choice["text"] = text
    choice["logprobs"] = _logprobs(shape, token_ids, logprobs, tok)
    choice["finish_reason"] = finish_reason
    if shape.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return choice


def _logprobs(
    shape: Shape, token_ids: list[int], lp: TokenLogprobs | None, tok: Tokenizer
) -> dict[str, Any] | None:
    if shape.num_logprobs is None or lp is None:
        return None
    k = shape.num_logprobs
    per_token = list(zip(token_ids, lp.chosen, lp.top, strict=True))
    if shape.chat:
        return {"content": [_chat_entry(t, chosen, top, k, tok) for t, chosen, top in per_token]}
    return {
        "tokens": [token_text(tok, t) for t in token_ids],
        "token_logprobs": list(lp.chosen),
        "top_logprobs": [{token_text(tok, i): v for i, v in _top(top, k)} for top in lp.top],
        "text_offset": list(lp.offsets),
    }


def _chat_entry(
    token_id: int, chosen: float, top: dict[int, float], k: int, tok: Tokenizer
) -> dict[str, Any]:
    return {
        **_chat_token(token_id, chosen, tok),
        "top_logprobs": [_chat_token(i, v, tok) for i, v in _top(top, k)],
    }


def _chat_token(token_id: int, logprob: float, tok: Tokenizer) -> dict[str, Any]:
    return {
        "token": token_text(tok, token_id),
        "logprob": logprob,
        "bytes": token_bytes(tok, token_id),
    }


def _top(top: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda kv: -kv[1])[:k]


def token_bytes(tok: Tokenizer, token_id: int) -> list[int] | None:
    """The token's raw bytes, also for a byte that is only part of a character (`token` then
    reads `token_id:N`); None for a token with no text (a special token), as OpenAI allows."""
    raw = getattr(tok, "token_bytes", None)  # the Tokenizer protocol does not require it
    if raw is not None:
        data = raw(token_id)
        return None if data is None else list(data)
    text = tok.decode([token_id])
    return list(text.encode()) if text and "\ufffd" not in text else None


def token_text(tok: Tokenizer, token_id: int) -> str:
    """A token's text; `token_id:N` (vLLM's spelling) when it is not text on its own (a special
    token, or part of a UTF-8 character)."""
    text = tok.decode([token_id])
    return text if text and "\ufffd" not in text else f"token_id:{token_id}"
