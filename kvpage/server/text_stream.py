"""Incremental detokenization with stop strings, at a cost per token that does not grow with the
output (decoding the whole output on every token made long streams quadratic).

The engine decodes text only when a request finishes; a stream needs it token by token. Each step
decodes a small window: the tokens emitted last time (context, so a tokenizer that spells a token
differently at the start of a text agrees with a whole decode) plus the tokens not emitted yet.
Text ending in U+FFFD is a character still arriving (UTF-8 split across byte tokens) and waits.
The first window starts with the prompt's last few tokens (`context`, vLLM's initial offset): a
completion is text that follows its prompt, and a SentencePiece decoder drops the leading space of
the first token of a text, so decoded alone the first completion token would lose its space.

Stop strings are looked for in the new text plus what is held back. Text that could still grow
into a stop string (at most the longest one less a character) is never sent, so a match never
starts in text already sent and nothing before the held-back tail needs scanning again.

`stop_at`, `held_back`, `offset_of` and the detokenizer's `still_arriving` are declared seams
(kvpage.server.seams): a verifier's mutant replaces them on a subclass, never a private name."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpage.model.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"
# Tokens held for a character that never completes (invalid bytes) before they go out as U+FFFD.
# Longer than any UTF-8 sequence (4 bytes); when forced, the last _TAIL tokens still wait, since
# they may be the start of a character that is still arriving.
_MAX_PENDING = 8
_TAIL = 3
CONTEXT_TOKENS = 6  # prompt tokens the first window starts with
# How far back the context may reach to start outside a run of byte-fallback tokens.
MAX_CONTEXT_TOKENS = 64


def run_member(tokenizer) -> Callable[[int], bool] | None:
    """Whether a token is read into a run of byte-fallback tokens (None: the decoder has no
    ByteFallback step): a `<0xNN>` token, or a token with no text — a special token the
    decode drops before the decoder joins the run, so one between two bytes does not end it."""
    fallback = getattr(tokenizer, "is_fallback_byte", None)
    if fallback is None:
        return None
    raw = tokenizer.token_bytes
    return lambda token_id: fallback(token_id) or raw(token_id) is None


def prompt_context(prompt_ids: list[int], tokenizer: Tokenizer | None = None) -> list[int]:
    """The prompt's tail a choice's text is decoded after (its first window's context): its
    last CONTEXT_TOKENS tokens, started further back where that would cut a run of byte-fallback
    tokens (`is_fallback_byte`). A ByteFallback decoder decodes such a run as one buffer, every
    byte of it U+FFFD when any part is not UTF-8: cut inside it, the run's tail decodes
    differently from the whole prompt (a stray continuation byte turns the completion's first
    bytes into U+FFFD; a valid character's first byte cut off, the same), and so would the
    completion's text. At most MAX_CONTEXT_TOKENS tokens; a longer run is cut where a character
    starts, so a run that is UTF-8 throughout still decodes as a whole prompt does."""
    start = max(len(prompt_ids) - CONTEXT_TOKENS, 0)
    joined = run_member(tokenizer)
    if joined is None:
        return list(prompt_ids[start:])
    floor = max(len(prompt_ids) - MAX_CONTEXT_TOKENS, 0)
    while start > floor and joined(prompt_ids[start]) and joined(prompt_ids[start - 1]):
        start -= 1
    if start > 0 and joined(prompt_ids[start]) and joined(prompt_ids[start - 1]):
        # Still inside a run: at its first token that is no UTF-8 continuation byte.
        for back in range(start, max(start - 4, -1), -1):
            if not _is_continuation(tokenizer.token_bytes(prompt_ids[back])):
                start = back
                break
    while start < len(prompt_ids) - 1 and tokenizer.token_bytes(prompt_ids[start]) is None:
        start += 1  # a special token before the run: no text, the decode skips it anyway
    return list(prompt_ids[start:])


@dataclass(slots=True)
class Detokenizer:
    """The stable text of a growing token list, a few tokens at a time (vLLM's two offsets)."""

    tokenizer: Tokenizer
    token_ids: list[int] = field(default_factory=list)  # the context, then the text's tokens
    prefix: int = 0  # the window starts here: the tokens emitted last time, as context
    read: int = 0  # tokens before this have been emitted
    start: int = 0  # the text's first token: those before it are the prompt's, context only
    # run_member(tokenizer), once: whether a token is read into a byte-fallback run
    member: Callable[[int], bool] | None = field(init=False, default=None)
    # Characters of the pending tokens' text already emitted: the text before a character
    # still arriving in the same token (byte-level "a\xc3": the "a").
    ahead: int = 0

    def __post_init__(self) -> None:
        self.member = run_member(self.tokenizer)

    @classmethod
    def after(cls, tokenizer: Tokenizer, context: list[int]) -> Detokenizer:
        """A text that follows `context` (the prompt's last tokens)."""
        return cls(tokenizer, list(context), 0, len(context), len(context))

    def add(self, new_ids: list[int], final: bool) -> str:
        """Append tokens; return the text they complete (everything left when `final`)."""
        self.token_ids.extend(new_ids)
        end = len(self.token_ids)
        text = self._decode(end)
        if not final and self.still_arriving(text, end):
            if end - self.read <= _MAX_PENDING:
                return self._text_before_pending(text, end)
            end -= _TAIL
            text = self._decode(end)
        new = text[len(self._decode(self.read)) :]
        if new:  # else the window keeps its start: a context of special tokens alone has no
            # text, and the next token would decode as a text's first (SentencePiece's leading
            # space dropped after an <unk>)
            self.prefix = min(self.read, self._run_start(end))
        self.read = end
        sent, self.ahead = self.ahead, max(self.ahead - len(new), 0)
        return new[sent:]

    def _text_before_pending(self, text: str, end: int) -> str:
        """The pending tokens' text before the character still arriving, not sent yet. Where
        one token holds both (byte-level BPE's "a\xc3"), that text is final — bytes before a
        character's start decode the same whatever follows — and a stop string in it must end
        the choice on this token. A byte-fallback run decodes as one buffer (its text may still
        change), and such a token holds one byte: nothing goes out before it."""
        joined = self.member
        if joined is not None and joined(self.token_ids[end - 1]):
            return ""
        before = text[len(self._decode(self.read)) : -1]  # the one U+FFFD: the partial bytes
        new, self.ahead = before[self.ahead :], max(self.ahead, len(before))
        return new

    def still_arriving(self, text: str, end: int) -> bool:
        """Whether `text`, the window decoded up to token `end`, ends in a character whose
        bytes are still arriving (U+FFFD that more tokens may turn into a character): that
        text waits for them. A declared seam (kvpage.server.seams)."""
        return text.endswith(_INCOMPLETE) and self._may_complete(end)

    def _may_complete(self, end: int) -> bool:
        """Whether the window's trailing U+FFFD may still become a character: its bytes end
        with the start of one (where the tokenizer gives its tokens' bytes). Bytes that are
        no character's start (a continuation byte after a complete character, "Ƙ" then 83 in
        one byte-level token) are final: the text before them is out now, and a stop string
        in it ends the choice on this token, not several later."""
        token_bytes = getattr(self.tokenizer, "token_bytes", None)
        if token_bytes is None:
            return True
        joined = self.member
        if joined is not None and joined(self.token_ids[end - 1]):
            # A ByteFallback run spells every byte U+FFFD until it is UTF-8 as a whole: it
            # waits while it may still become that; once it cannot, its text is final.
            run = self.token_ids[self._run_start(end) : end]
            return _utf8_so_far(b"".join(token_bytes(t) or b"" for t in run))
        data = b"".join(
            token_bytes(t) or b"" for t in self.token_ids[max(self.prefix, end - 4) : end]
        )
        return any(
            data[-n] >= 0xC0 and _one_char_so_far(data[-n:]) and not _is_one_char(data[-n:])
            for n in range(1, min(len(data), 3) + 1)
        )

    def _run_start(self, end: int) -> int:
        """Where the run of byte-fallback tokens that token `end - 1` ends starts (`end`: it
        is in none), within the window and at most MAX_CONTEXT_TOKENS back: the next window
        starts there, since the decoder reads a run as one buffer."""
        joined = self.member
        start, floor = end, max(end - MAX_CONTEXT_TOKENS, self.prefix)
        while joined is not None and start > floor and joined(self.token_ids[start - 1]):
            start -= 1
        if start > self.prefix and start < end and joined(self.token_ids[start - 1]):
            # Cut inside a longer run (JSON whitespace is one): start where a character does,
            # as prompt_context does; a stray continuation byte would turn the whole window's
            # run into U+FFFD.
            token_bytes = self.tokenizer.token_bytes
            while start < end and _is_continuation(token_bytes(self.token_ids[start])):
                start += 1
        return start

    def _decode(self, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[self.prefix : end]) if end > self.prefix else ""

    def start_of(self, token_id: int) -> int:
        """Where the text of `token_id`, appended next, starts, counted in characters from the
        end of the text emitted so far. A token that continues a character still arriving
        (a UTF-8 byte) starts where that character does; one that follows pending text that
        is already final (an invalid byte, shown as U+FFFD) starts after it."""
        end = len(self.token_ids)
        context = len(self._decode(self.read)) + self.ahead
        lead = self._lead_of(token_id)
        if lead is not None:  # a byte of a character still arriving: where its first byte is
            return len(self._decode(lead)) - context
        before = self._decode(end)
        if not self.tokenizer.decode([token_id]):  # no text of its own: a special token
            return len(before) - context
        after = self.tokenizer.decode(self.token_ids[self.prefix :] + [token_id])
        common = next(
            (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), None
        )
        if common is None:  # `after` extends `before`, or the token joined its last character
            common = min(len(before), max(len(after) - 1, 0))
        # Never inside text already emitted: a ByteFallback decoder turns a whole byte run into
        # U+FFFD when a byte that is not UTF-8 joins it, changing the window's text before this
        # token, but that text is out (the token's own starts after it).
        return max(common - context, 0)

    def _lead_of(self, token_id: int) -> int | None:
        """If `token_id` is a UTF-8 continuation byte of the character the pending byte tokens
        began, the index of the token holding that character's first byte. Needed where a
        tokenizer spells each pending byte as its own U+FFFD (byte-fallback BPE): the text then
        grows by one U+FFFD per byte and says nothing about where the character starts."""
        token_bytes = getattr(self.tokenizer, "token_bytes", None)
        if token_bytes is None or not _is_continuation(token_bytes(token_id)):
            return None
        tail = token_bytes(token_id)
        for k in range(len(self.token_ids) - 1, self.read - 1, -1):
            piece = token_bytes(self.token_ids[k])
            if _is_continuation(piece):
                tail = piece + tail
            elif piece is not None and len(piece) == 1:
                return k if _one_char_so_far(piece + tail) and self._run_ok(k, tail) else None
            else:
                return None
        return None

    def _run_ok(self, lead: int, tail: bytes) -> bool:
        """Whether the character begun at `lead` is text in the window: a ByteFallback decoder
        reads the window's whole run of byte-fallback tokens as one buffer, one U+FFFD per byte
        when some byte of it is not UTF-8 (A2 C8 86: three, not U+FFFD then Ȇ), and then each
        byte is a character of its own."""
        joined = self.member
        if joined is None:
            return True
        start = lead
        while start > self.prefix and joined(self.token_ids[start - 1]):
            start -= 1
        run = b"".join(self.tokenizer.token_bytes(t) or b"" for t in self.token_ids[start:lead])
        try:
            codecs.getincrementaldecoder("utf-8")().decode(
                run + self.tokenizer.token_bytes(self.token_ids[lead]) + tail, final=False
            )
        except UnicodeDecodeError:
            return False
        return True


def _byte_runs(ids: list[int], fallback, raw) -> list[list[int]]:
    """The positions of each run of byte-fallback tokens, special tokens (no bytes) inside
    one skipped."""
    runs: list[list[int]] = [[]]
    for j, t in enumerate(ids):
        if fallback(t):
            runs[-1].append(j)
        elif raw(t) is not None and runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def _char_starts(data: bytes) -> list[int] | None:
    """For each byte of `data`, the index of the character holding it; None where `data` is
    not UTF-8 as a whole."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    starts = []
    for index, char in enumerate(text):
        starts += [index] * len(char.encode("utf-8"))
    return starts


def _utf8_so_far(data: bytes) -> bool:
    """Whether `data` is UTF-8, or the start of some (a character's first bytes at its end)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _is_one_char(data: bytes) -> bool:
    try:
        return len(data.decode("utf-8")) == 1
    except UnicodeDecodeError:
        return False


def _is_continuation(piece: bytes | None) -> bool:
    return piece is not None and len(piece) == 1 and 0x80 <= piece[0] < 0xC0


def _one_char_so_far(data: bytes) -> bool:
    """Whether `data` is one UTF-8 character or the start of one. The decoder, not a lead-byte
    width table, decides: E0 95 is no character's start (E0 must be followed by A0..BF), so
    there 95 is a U+FFFD of its own, as the whole text decodes."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    if text:
        return len(text) == 1 and text.encode() == data
    # Python's incremental decoder waits on some bytes no character can follow (ED A0: a
    # surrogate's start): the start of one only if some continuation makes it a character.
    return any(_decodes_to_one(data + bytes([b]) * (4 - len(data))) for b in (0x80, 0x90, 0xA0))


def _decodes_to_one(data: bytes) -> bool:
    for end in range(1, len(data) + 1):
        try:
            if len(data[:end].decode("utf-8")) == 1:
                return True
        except UnicodeDecodeError:
            continue
    return False


@dataclass(slots=True)
class TextStream:
    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    context: list[int] = field(default_factory=list)  # the prompt's last tokens (prompt_context)
    stopped: bool = False  # a stop string matched; the text ends before it
    detok: Detokenizer = field(init=False)
    held: str = ""  # decoded, not sent: it may be the start of a stop string
    pieces: list[str] = field(default_factory=list)  # text sent, in order
    longest: int = field(init=False)
    first_chars: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.detok = Detokenizer.after(self.tokenizer, self.context)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.first_chars = frozenset(s[0] for s in self.stop if s)

    @property
    def token_ids(self) -> list[int]:
        return self.detok.token_ids[self.detok.start :]

    def add(self, new_ids: list[int], final: bool) -> str:
        """Append tokens; return the text that may be sent now (all of it when `final`)."""
        if self.stopped:  # the text is over; keep the ids (usage counts them), decode nothing
            self.detok.token_ids.extend(new_ids)
            return ""
        new = self.detok.add(new_ids, final)
        window = self.held + new
        cut = self.stop_at(window)
        if cut is not None:
            self.stopped = True
            return self._emit(window[:cut], "")
        keep = 0 if final else self.held_back(window)
        return self._emit(window[: len(window) - keep], window[len(window) - keep :])

    def offset_of(self, token_id: int) -> int:
        """OpenAI's `text_offset` of `token_id`, appended next: where its text starts in the
        choice's text (the text's length once a stop string has ended it)."""
        if self.stopped:
            return len(self.text)
        return len(self.text) + len(self.held) + self.detok.start_of(token_id)

    def settled_offsets(self, offsets: list[int]) -> list[int]:
        """`offsets` (one per token, as offset_of gave them) once the text is complete, by the
        ByteFallback rule: a run of byte-fallback tokens (special tokens inside it skipped, as
        the decode skips them) is one buffer — UTF-8 as a whole, each byte starts where its
        character does; else one U+FFFD per byte, each its own character — counted from where
        the run's first byte starts. While the run was arriving a byte was put where its
        character would start; a whole response says how the run ended, a stream has sent
        the first answer."""
        fallback = getattr(self.tokenizer, "is_fallback_byte", None)
        if fallback is None:
            return offsets
        ids, out = self.token_ids[: len(offsets)], list(offsets)
        for run in _byte_runs(ids, fallback, self.tokenizer.token_bytes):
            data = b"".join(self.tokenizer.token_bytes(ids[j]) for j in run)
            starts = _char_starts(data)
            for p, j in enumerate(run):
                out[j] = offsets[run[0]] + (starts[p] if starts is not None else p)
        return out

    def stop_at(self, window: str) -> int | None:
        """Where the earliest stop string found in `window` starts (None: none found)."""
        hits = [i for s in self.stop if (i := window.find(s)) >= 0]
        return min(hits) if hits else None

    def held_back(self, window: str) -> int:
        """Length of the longest tail of `window` that a stop string starts with (< longest)."""
        if self.longest < 2:
            return 0
        tail = window[-(self.longest - 1) :]
        for i, ch in enumerate(tail):  # longest tail first
            if ch in self.first_chars and any(s.startswith(tail[i:]) for s in self.stop):
                return len(tail) - i
        return 0

    def _emit(self, piece: str, held: str) -> str:
        self.held = held
        if piece:
            self.pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """Everything sent so far."""
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""
