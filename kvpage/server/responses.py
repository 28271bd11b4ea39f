"""OpenAI response bodies and stream chunks for completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvpage.model.tokenizer import Tokenizer
from kvpage.server.generation import Delta, Generation
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

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def sse(body: dict[str, Any] | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


def new_shape(chat: bool, model: str, num_logprobs: int | None, token_ids: bool) -> Shape:
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    return Shape(chat, request_id, model, num_logprobs, token_ids, int(time.time()))


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
    return _envelope(shape, [choice], chunk=True)


def role_chunk(shape: Shape, index: int = 0) -> dict[str, Any]:
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    return _envelope(shape, [choice], chunk=True)


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


def _logprobs(shape: Shape, token_ids, logprobs, tok: Tokenizer) -> dict[str, Any] | None:
    if shape.num_logprobs is None or logprobs is None:
        return None
    k = shape.num_logprobs
    if shape.chat:
        return {
            "content": [
                _chat_entry(t, lp, k, tok) for t, lp in zip(token_ids, logprobs, strict=True)
            ]
        }
    tokens = [token_text(tok, t) for t in token_ids]
    offsets = [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs, strict=True)],
        "top_logprobs": [{token_text(tok, i): v for i, v in _top(lp, k)} for lp in logprobs],
        "text_offset": offsets,
    }


def _chat_entry(token_id: int, top: dict[int, float], k: int, tok: Tokenizer) -> dict[str, Any]:
    text = token_text(tok, token_id)
    return {
        "token": text,
        "logprob": top.get(token_id),  # known when the token is in the engine's top-k
        "bytes": list(text.encode()),
        "top_logprobs": [
            {"token": token_text(tok, i), "logprob": v, "bytes": list(token_text(tok, i).encode())}
            for i, v in _top(top, k)
        ],
    }


def _top(top: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda kv: -kv[1])[:k]


def token_text(tok: Tokenizer, token_id: int) -> str:
    """A token's text; `token_id:N` (vLLM's spelling) when it is not text on its own (a special
    token, or part of a UTF-8 character)."""
    text = tok.decode([token_id])
    return text if text and "\ufffd" not in text else f"token_id:{token_id}"
