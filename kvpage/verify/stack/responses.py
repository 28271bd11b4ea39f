"""A response as the suite compares it: the choices of a body, or of a stream's chunks put back
together (text and per-token lists concatenated per choice), plus what the framing broke."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(slots=True)
class GotChoice:
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    entries: list[dict] | None = None  # per token: token, logprob, top, offset | bytes
    finishes: int = 0  # chunks that carried a finish_reason (a stream sends exactly one)


@dataclass(slots=True)
class GotResponse:
    status: int
    body: dict | None  # the JSON body (a non-streamed answer or an error)
    choices: dict[int, GotChoice] = field(default_factory=dict)
    usage: dict | None = None
    framing: list[str] = field(default_factory=list)  # what is wrong with the envelope/stream


def parse_body(status: int, body: dict, chat: bool) -> GotResponse:
    got = GotResponse(status, body, usage=body.get("usage"))
    for c in body.get("choices", []):
        choice = got.choices.setdefault(c["index"], GotChoice())
        _add(choice, c, chat, "message")
    return got


def parse_stream(status: int, raw: str, chat: bool, include_usage: bool) -> GotResponse:
    got = GotResponse(status, None)
    events = [line[len("data: ") :] for line in raw.split("\n\n") if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        got.framing.append("the stream does not end with [DONE]")
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    if len({(c.get("id"), c.get("created")) for c in chunks}) > 1:
        got.framing.append("chunks of one stream carry different ids or created times")
    for chunk in chunks:
        _add_chunk(got, chunk, chat, include_usage)
    if include_usage and (not chunks or chunks[-1].get("choices")):
        got.framing.append("include_usage: the last chunk must be the usage chunk")
    got.body = chunks[0] if chunks else None
    return got


def _add_chunk(got: GotResponse, chunk: dict, chat: bool, include_usage: bool) -> None:
    if include_usage and chunk.get("choices") and chunk.get("usage", "absent") is not None:
        got.framing.append("include_usage: a chunk with choices must carry usage: null")
    if not include_usage and "usage" in chunk:
        got.framing.append("a stream without include_usage carries usage")
    if not chunk.get("choices") and chunk.get("usage") is not None:
        got.usage = chunk["usage"]
    for c in chunk.get("choices", []):
        choice = got.choices.setdefault(c["index"], GotChoice())
        if choice.finish_reason is not None:
            got.framing.append(f"choice {c['index']}: a chunk after its finish_reason")
        _add(choice, c, chat, "delta")


def _add(choice: GotChoice, c: dict, chat: bool, key: str) -> None:
    choice.text += (c[key].get("content") or "") if chat else c["text"]
    if c.get("finish_reason") is not None:
        choice.finish_reason = c["finish_reason"]
        choice.finishes += 1
    if "token_ids" in c:
        choice.token_ids = (choice.token_ids or []) + list(c["token_ids"])
    if c.get("logprobs") is not None:
        choice.entries = (choice.entries or []) + _entries(c["logprobs"], chat)


def _entries(lp: dict, chat: bool) -> list[dict]:
    if chat:
        return [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": e["bytes"],
                "top": {t["token"]: t["logprob"] for t in e["top_logprobs"]},
                "top_bytes": {t["token"]: t["bytes"] for t in e["top_logprobs"]},
            }
            for e in lp["content"]
        ]
    rows = zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"], strict=True
    )
    return [{"token": t, "logprob": v, "top": top, "offset": o} for t, v, top, o in rows]
