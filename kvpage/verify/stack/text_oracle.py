"""The text-level oracle: what an OpenAI-compatible server must answer for one choice, computed
from the contiguous reference's token ids alone, without the server's text stream.

Everything is derived from the tokens' raw bytes (the tokenizer's `token_bytes`), decoded here
as UTF-8 with U+FFFD for bytes that are not a character, as the whole text would decode:
  - stop strings (OpenAI): the text ends before the first stop string to appear as the tokens
    arrive, finish_reason "stop"; the tokens reported are those up to the one that completed it;
  - `text_offset`: the character where each token's text starts in the choice's text — a byte
    inside a multi-byte character starts where that character does; a token with no text (EOS)
    starts after everything before it; a token past a stop string, where the text ends;
  - logprobs: the raw distribution's log-softmax, the chosen token's and the top k."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FFFD = "\ufffd"


def token_pieces(tokenizer, token_ids: list[int]) -> list[bytes]:
    """Each token's raw bytes; b"" for a token with no text (BOS, EOS)."""
    return [tokenizer.token_bytes(t) or b"" for t in token_ids]


def decode(pieces: list[bytes]) -> str:
    return b"".join(pieces).decode("utf-8", errors="replace")


def token_text(piece: bytes, token_id: int) -> str:
    """A token's own text; `token_id:N` when its bytes are not text on their own."""
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError:
        return f"token_id:{token_id}"
    return text if text else f"token_id:{token_id}"


def is_char_boundary(data: bytes, at: int) -> bool:
    """Whether a character starts at byte `at`: splitting there decodes to the same text."""
    whole = data.decode("utf-8", errors="replace")
    split = data[:at].decode("utf-8", errors="replace") + data[at:].decode("utf-8", "replace")
    return whole == split


def char_index(data: bytes, at: int) -> int:
    """The character (in the decoded text) holding byte `at`, by brute force."""
    start = max(b for b in range(at + 1) if is_char_boundary(data, b))
    return len(data[:start].decode("utf-8", errors="replace"))


def text_offsets(pieces: list[bytes], text_len: int) -> list[int]:
    data = b"".join(pieces)
    offsets, at = [], 0
    for piece in pieces:
        before = len(data[:at].decode("utf-8", errors="replace"))  # a token with no text
        offset = char_index(data, at) if piece else before
        offsets.append(min(offset, text_len))
        at += len(piece)
    return offsets


@dataclass(frozen=True, slots=True)
class StopCut:
    tokens: int  # tokens reported: up to the one that completed the stop string
    chars: int  # the text's length: it ends where the stop string starts
    stop: str  # the stop string that ended it


def find_stop(pieces: list[bytes], stops: list[str]) -> StopCut | None:
    """The first stop string to appear as the tokens arrive one by one (the earliest-starting
    one when several complete on the same token)."""
    if not stops:
        return None
    for k in range(1, len(pieces) + 1):
        text = decode(pieces[:k])
        hits = sorted((text.find(s), s) for s in stops if s in text)
        if hits:
            return StopCut(k, hits[0][0], hits[0][1])
    return None


@dataclass(frozen=True, slots=True)
class TokenEntry:
    token_id: int
    text: str  # `tokens` / `token` spelling
    piece: bytes  # raw bytes (chat's `bytes`; None there when empty)
    logprob: float
    top: dict[str, float]  # the k most likely tokens, by their spelling -> logprob
    top_bytes: dict[str, bytes]  # their raw bytes (chat's `bytes`)
    offset: int  # text_offset
    # Every token within the tolerance below the k-th (the top k among them), by spelling ->
    # (logprob, raw bytes): the tokens a top k may hold when logits tie (16-bit models).
    band: dict[str, tuple[float, bytes]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ExpectedChoice:
    index: int
    text: str
    finish_reason: str
    token_ids: list[int]
    entries: list[TokenEntry] | None  # None: no logprobs asked for
    stop: str | None  # the stop string that ended it, if one did


def expected_choice(
    tokenizer,
    index: int,
    token_ids: list[int],
    step_logits: list[torch.Tensor],
    finish_reason: str,
    stops: list[str],
    num_logprobs: int | None,
    stream: bool = False,
    atol: float = 0.0,
) -> ExpectedChoice:
    """The choice a server must return for the reference's tokens of one sample. `stream`: a
    stream cannot take back what it sent, so the offsets of a stop string's tokens that came
    before the one completing it are where their text starts (a whole response says where the
    text ends, as for the tokens after it). `atol`: the logit tolerance, how far below the k-th
    logprob each entry's band reaches."""
    pieces = token_pieces(tokenizer, token_ids)
    cut = find_stop(pieces, stops)
    if cut is not None:
        token_ids, pieces = token_ids[: cut.tokens], pieces[: cut.tokens]
        text, finish_reason = decode(pieces)[: cut.chars], "stop"
    else:
        text = decode(pieces)
    entries = None
    if num_logprobs is not None:
        sent = cut.tokens - 1 if stream and cut is not None else 0  # offsets already out
        entries = _entries(tokenizer, token_ids, step_logits, num_logprobs, len(text), sent, atol)
    return ExpectedChoice(
        index, text, finish_reason, list(token_ids), entries, cut.stop if cut else None
    )


def _entries(tokenizer, token_ids, step_logits, k, text_len, sent, atol) -> list[TokenEntry]:
    pieces = token_pieces(tokenizer, token_ids)
    offsets = text_offsets(pieces, text_len)
    offsets[:sent] = text_offsets(pieces, len(decode(pieces)))[:sent]
    entries = []
    for token, piece, logits, offset in zip(token_ids, pieces, step_logits, offsets, strict=False):
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (V,) the raw distribution
        top, top_bytes, band = {}, {}, {}
        if k:
            values, ids = torch.topk(logprobs, k)
            for i, v in zip(ids.tolist(), values.tolist(), strict=True):
                alt = token_pieces(tokenizer, [i])[0]
                top[token_text(alt, i)], top_bytes[token_text(alt, i)] = float(v), alt
            near = (logprobs >= float(values[-1]) - atol).nonzero()[:, 0].tolist()
            for i in near:
                alt = token_pieces(tokenizer, [i])[0]
                band[token_text(alt, i)] = (float(logprobs[i]), alt)
        text = token_text(piece, token)
        chosen = float(logprobs[token])
        entries.append(TokenEntry(token, text, piece, chosen, top, top_bytes, offset, band))
    return entries
