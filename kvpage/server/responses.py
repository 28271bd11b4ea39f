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
from kvpage.server.text_stream import TextStream
from kvpage.server.tool_calls import ToolPolicy


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
    echo: bool = False  # completions: each choice starts with the prompt (and its logprobs)
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` field, with this top k
    tokens_as_ids: bool = False  # vLLM's `return_tokens_as_token_ids`: every token `token_id:N`
    tools: ToolPolicy | None = None  # chat: the reply read as tool calls (kvpage.server.tool_calls)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def sse(body: dict[str, Any] | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


def new_shape(
    chat: bool,
    model: str,
    num_logprobs: int | None,
    token_ids: bool,
    include_usage: bool = False,
    echo: bool = False,
    prompt_logprobs: int | None = None,
    tokens_as_ids: bool = False,
) -> Shape:
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    return Shape(
        chat,
        request_id,
        model,
        num_logprobs,
        token_ids,
        created,
        include_usage,
        echo,
        prompt_logprobs,
        tokens_as_ids,
    )


@dataclass(slots=True)
class Echo:
    """The prompt as the start of every choice (completions' `echo`): its text, its tokens
    and, when logprobs were asked for, theirs (None for the first token: nothing precedes it)."""

    text: str
    token_ids: list[int]
    logprobs: TokenLogprobs | None

    def before(self, text: str, token_ids: list[int], lp: TokenLogprobs | None):
        """A choice's (or its first delta's) text, tokens and logprobs after the prompt."""
        if lp is not None and self.logprobs is not None:
            shift = len(self.text)
            lp = TokenLogprobs(
                self.logprobs.top + lp.top,
                self.logprobs.chosen + lp.chosen,
                self.logprobs.offsets + [o + shift for o in lp.offsets],
            )
        return self.text + text, self.token_ids + list(token_ids), lp


def echo_of(gen: Generation, tok: Tokenizer, with_logprobs: bool) -> Echo:
    """The prompt decoded token by token, so each token's offset is where its text starts."""
    ids = list(gen.prompt_ids)
    stream, offsets = TextStream(tok, []), []
    for i, token in enumerate(ids):
        offsets.append(stream.offset_of(token))
        stream.add([token], final=i == len(ids) - 1)
    if not with_logprobs or gen.prompt_logprobs is None:
        return Echo(stream.text, ids, None)
    rows = gen.prompt_logprobs
    chosen = [None] + [row[t] for row, t in zip(rows[1:], ids[1:], strict=True)]
    return Echo(stream.text, ids, TokenLogprobs([None, *rows[1:]], chosen, offsets))


def shift_offsets(lp: TokenLogprobs | None, by: int) -> TokenLogprobs | None:
    """A later delta's logprobs when the choice's text starts with an echoed prompt."""
    if lp is None or not by:
        return lp
    return TokenLogprobs(lp.top, lp.chosen, [o + by for o in lp.offsets])


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
    echo = echo_of(gen, tok, shape.num_logprobs is not None) if shape.echo else None
    for c in gen.choices:
        lps = c.logprobs if shape.num_logprobs is not None else None
        text, ids = c.text.text, c.token_ids
        if echo is not None:
            text, ids, lps = echo.before(text, ids, lps)
        choice = _choice(shape, c.index, text, ids, lps, c.finish_reason, tok, False)
        if shape.tools is not None:
            choice["message"], choice["finish_reason"] = shape.tools.message(text, c.finish_reason)
        choices.append(_with_prompt_logprobs(shape, choice, gen, tok))
    body = _envelope(shape, choices, chunk=False)
    if shape.chat and shape.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_field(gen, shape.prompt_logprobs, tok)
    body["usage"] = usage(len(gen.prompt_ids), gen.num_tokens, gen.cached_tokens)
    return body


def chunk_body(
    shape: Shape,
    delta: Delta,
    tok: Tokenizer,
    echo: Echo | None = None,
    first: bool = False,
    gen: Generation | None = None,
) -> dict[str, Any]:
    """One delta as a chunk. With echo, a choice's first chunk starts with the prompt and
    every offset counts the prompt's text; a choice's first chunk carries prompt_logprobs."""
    text, ids, lps = delta.text, delta.token_ids, delta.logprobs
    if echo is not None:
        if first:
            text, ids, lps = echo.before(text, ids, lps)
        else:
            lps = shift_offsets(lps, len(echo.text))
    choice = _choice(shape, delta.index, text, ids, lps, delta.finish_reason, tok, True)
    if first and gen is not None:
        choice = _with_prompt_logprobs(shape, choice, gen, tok)
    body = _stream_envelope(shape, [choice])
    if first and gen is not None and shape.chat and shape.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_field(gen, shape.prompt_logprobs, tok)
    return body


def _with_prompt_logprobs(shape: Shape, choice: dict, gen: Generation, tok: Tokenizer) -> dict:
    if not shape.chat and shape.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_field(gen, shape.prompt_logprobs, tok)
    return choice


def prompt_logprobs_field(gen: Generation, k: int, tok: Tokenizer) -> list | None:
    """vLLM's shape: None for the first prompt token, then per token {token id (a string, as
    JSON keys are): {logprob, rank, decoded_token}}: the top k (rank 1..k) and the prompt token
    itself, whose rank is null when it is outside the top k (its rank is not computed)."""
    rows = gen.prompt_logprobs
    if rows is None:
        return None
    out: list[dict | None] = [None]
    for row, token in zip(rows[1:], gen.prompt_ids[1:], strict=True):
        top = _top(row, k)
        entry = {
            str(t): {"logprob": v, "rank": r, "decoded_token": token_text(tok, t)}
            for r, (t, v) in enumerate(top, start=1)
        }
        if str(token) not in entry:
            entry[str(token)] = {
                "logprob": row[token],
                "rank": None,
                "decoded_token": token_text(tok, token),
            }
        out.append(entry)
    return out


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
    k, as_ids = shape.num_logprobs, shape.tokens_as_ids
    per_token = list(zip(token_ids, lp.chosen, lp.top, strict=True))
    if shape.chat:
        return {
            "content": [_chat_entry(t, chosen, top, k, tok, as_ids) for t, chosen, top in per_token]
        }
    keyed = [_top_with_chosen(t, c, top, k, tok, as_ids) for t, c, top in per_token]
    return {
        "tokens": [name for name, _ in keyed],
        "token_logprobs": list(lp.chosen),
        "top_logprobs": [entries for _, entries in keyed],
        "text_offset": list(lp.offsets),
    }


def _top_with_chosen(
    token_id: int, chosen: float, top: dict[int, float] | None, k: int, tok: Tokenizer, as_ids: bool
) -> tuple[str, dict[str, float] | None]:
    """The chosen token's spelling and its position's `top_logprobs`: the top k and the chosen
    token, k + 1 entries when it is outside them (OpenAI and vLLM); None for an echoed prompt's
    first token. Two tokens never share a key: the text belongs to the higher-ranked one and
    each later token spelled the same is keyed `token_id:N` (a dict keyed by text would keep
    only the last, so the top-1 token's entry would read a lower logprob, and the chosen token
    could look greedy when it was not). The chosen token is spelled as its key, so `tokens[i]`
    always names its own entry (lm-eval's is_greedy compares the two)."""
    if top is None:
        return _spelling(tok, token_id, as_ids), None
    entries: dict[str, float] = {}
    names: dict[int, str] = {}
    for i, v in [*_top(top, k), (token_id, chosen)]:  # by rank; the chosen token last
        if i in names:
            continue
        name = _spelling(tok, i, as_ids)
        names[i] = name if name not in entries else f"token_id:{i}"
        entries[names[i]] = v
    return names[token_id], entries


def _spelling(tok: Tokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else token_text(tok, token_id)


def _chat_entry(
    token_id: int, chosen: float, top: dict[int, float], k: int, tok: Tokenizer, as_ids: bool
) -> dict[str, Any]:
    """Chat's alternatives are a list, so two tokens spelled alike stay two entries."""
    return {
        **_chat_token(token_id, chosen, tok, as_ids),
        "top_logprobs": [_chat_token(i, v, tok, as_ids) for i, v in _top(top, k)],
    }


def _chat_token(token_id: int, logprob: float, tok: Tokenizer, as_ids: bool) -> dict[str, Any]:
    """`bytes` stay the token's own bytes when `token` is spelled `token_id:N`."""
    return {
        "token": _spelling(tok, token_id, as_ids),
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
    token, or part of a UTF-8 character). From the token's own bytes where the tokenizer gives
    them: decoded alone, a SentencePiece token loses its leading space (the decoder's rule for
    the start of a text), and the tokens would not add up to the text."""
    raw = getattr(tok, "token_bytes", None)
    if raw is not None:
        data = raw(token_id)
        try:
            text = data.decode("utf-8") if data else ""
        except UnicodeDecodeError:
            text = ""
    else:
        text = tok.decode([token_id])
    return text if text and "\ufffd" not in text else f"token_id:{token_id}"
