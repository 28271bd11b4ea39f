"""The text-level oracle: what an OpenAI-compatible server must answer for one choice, computed
from the contiguous reference's token ids and the served model's tokenizer read independently of
kvpage's (an oracle that shared kvpage's text handling would check it against itself):

  - the built-in byte tokenizer (`ByteText`): its definition, written here — ids 0..255 are
    bytes, then BOS and EOS; text is the bytes decoded as UTF-8 with U+FFFD for bytes that are
    not a character, as the whole text would decode;
  - a Hugging Face directory (`HFText`): transformers' AutoTokenizer on the directory (its own
    loader, special tokens and chat template). A choice's text is decode(prompt + tokens) less
    decode(prompt), as an incremental detokenizer must give it (a SentencePiece decoder drops
    the leading space of the first token of a text, never of a completion's first token).

Then, from the texts the tokens make as they arrive:
  - stop strings (OpenAI): the text ends before the first stop string to appear as the tokens
    arrive, finish_reason "stop"; the tokens reported are those up to the one that completed it;
  - `text_offset`: the character where each token's text starts in the choice's text — a byte
    inside a multi-byte character starts where that character does; a token with no text (EOS)
    starts after everything before it; a token past a stop string, where the text ends;
  - logprobs: the raw distribution's log-softmax, the chosen token's and the top k.

A tokenizer whose decode is not prefix-stable (Hugging Face's ByteFallback decodes a run of byte
tokens at once: one invalid byte turns the run's valid characters into U+FFFD too, after a
stream has sent them) has no one right text past the first such run: there the text must start
with the stable part (`ExpectedChoice.stable`), and the fields past it are not judged."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

import torch

FFFD = "\ufffd"


UNKNOWN = object()  # a token's raw bytes the independent tokenizer does not give (not judged)


class ByteText:
    """The built-in models' byte tokenizer, by its definition: ids 0..255 are those bytes, then
    BOS (256) and EOS (257), which have no text; encoding prepends BOS."""

    NUM_BYTES = 256
    bos_token_id = NUM_BYTES
    has_template = False  # the built-in chat template (chat_prompt) is the models' documented one

    def piece(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < self.NUM_BYTES else b""

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_token_id] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return decode([self.piece(t) for t in ids])

    def spell(self, token_id: int) -> str:
        return token_text(self.piece(token_id), token_id)

    def raw(self, token_id: int):
        """chat's `bytes`: b"" (null) for a token with no text."""
        return self.piece(token_id)


class HFText:
    """A Hugging Face directory's tokenizer through transformers' AutoTokenizer: its loader, its
    special tokens, its decoder, its chat template (`chat_template.jinja` or tokenizer_config's
    `chat_template`) — none of kvpage's tokenizer code."""

    def __init__(self, directory: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(directory)
        self.bos_token_id = self.tok.bos_token_id
        self.has_template = bool(getattr(self.tok, "chat_template", None))
        # The named special tokens and every added token marked special (which decode skips).
        added = getattr(self.tok, "added_tokens_decoder", {})
        self.special = set(self.tok.all_special_ids) | {
            i for i, t in added.items() if getattr(t, "special", False)
        }
        self.anchor = self._anchor()
        self.anchor_text = self.decode([self.anchor])
        self.memo: dict[int, str] = {}
        self.fallback_bytes = self._fallback_bytes()

    def _fallback_bytes(self) -> dict[int, int]:
        """Byte-fallback tokens (`<0xNN>`, SentencePiece's spelling of a byte no piece has) ->
        their byte, where the decoder reads them as bytes (<0x41> decodes to "A")."""
        ids = {}
        for b in range(256):
            i = self.tok.convert_tokens_to_ids(f"<0x{b:02X}>")
            if isinstance(i, int) and i != self.tok.unk_token_id and i not in self.special:
                ids[i] = b
        probe = next((i for i, b in ids.items() if b == 0x41), None)
        return ids if probe is not None and self.decode([probe]) == "A" else {}

    def _anchor(self) -> int:
        """A plain token (an ASCII word, no byte token) that a token is spelled after: the
        spelling of a token as it reads inside a text, not at its start."""
        names = self.tok.convert_ids_to_tokens(list(range(len(self.tok))))
        for i, name in enumerate(names):
            text = self.decode([i])
            if i in self.special or not name or name.startswith("<0x") or len(name) < 2:
                continue
            if text.strip().isascii() and text.strip().isalnum():
                return i
        raise ValueError("no plain token to spell tokens after")

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return list(self.tok(text, add_special_tokens=bos)["input_ids"])

    def chat(self, messages: list[dict]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def spell(self, token_id: int) -> str:
        """The text the token adds after a plain token; `token_id:N` when it adds none or
        not a whole character."""
        if token_id not in self.memo:
            after = self.decode([self.anchor, token_id])
            text = after[len(self.anchor_text) :] if after.startswith(self.anchor_text) else ""
            ok = text and FFFD not in text and token_id not in self.special
            self.memo[token_id] = text if ok else f"token_id:{token_id}"
        return self.memo[token_id]

    def raw(self, token_id: int):
        """chat's `bytes`: b"" (null) for a special token, the spelling's UTF-8 for a token that
        is text, UNKNOWN for part of a character (its byte is not read here)."""
        if token_id in self.special:
            return b""
        text = self.spell(token_id)
        return UNKNOWN if text.startswith("token_id:") else text.encode("utf-8")


def text_model(model_name: str, tokenizer):
    """The oracle's tokenizer for a served model: its directory's, read by transformers, or
    the byte tokenizer's definition for a built-in model (None: no tokenizer, no text)."""
    from pathlib import Path

    if (Path(model_name) / "tokenizer.json").is_file() or (
        Path(model_name) / "tokenizer_config.json"
    ).is_file():
        return HFText(model_name)
    if tokenizer is None:
        return None
    return ByteText()


def token_pieces(text_model, token_ids: list[int]) -> list[bytes]:
    """Each token's raw bytes under the byte tokenizer's definition; b"" for BOS, EOS."""
    return [text_model.piece(t) for t in token_ids]


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


def _lcp(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def choice_texts(text_model, context: list[int], token_ids: list[int]) -> list[str]:
    """The choice's text after each of its first k tokens (k = 0..n): decode(context + tokens)
    less decode(context) for a Hugging Face tokenizer; the bytes decoded for the byte one."""
    if isinstance(text_model, ByteText):
        pieces = token_pieces(text_model, token_ids)
        return [decode(pieces[:k]) for k in range(len(pieces) + 1)]
    context = list(context)
    base = text_model.decode(context)
    out = []
    for k in range(len(token_ids) + 1):
        whole = text_model.decode(context + list(token_ids[:k]))
        if not whole.startswith(base):  # the prompt's own text changed: unstable from 0
            return (
                ["\uffff"]
                + [  # never a prefix of any text: stable from nothing
                    text_model.decode(context + list(token_ids[:j]))[len(base) :]
                    for j in range(1, len(token_ids) + 1)
                ]
            )
        out.append(whole[len(base) :])
    return out


def stable_length(texts: list[str]) -> int | None:
    """How much of the final text every earlier text agrees with (a pending character, a
    trailing U+FFFD, may still become anything); None when all of it (prefix-stable)."""
    final, stable = texts[-1], len(texts[-1])
    for text in texts[:-1]:
        core = text.rstrip(FFFD)
        if not final.startswith(core):
            stable = min(stable, _lcp(core, final))
    return None if stable == len(final) else stable


def hf_offsets(texts: list[str], token_ids: list[int], text_model) -> list[int]:
    """Where each token's text starts, from the texts before and after it: at the first
    character it changed (it completed or replaced a pending one), else at the end of the text
    before it; a token that adds nothing starts at the last character (it joined it) unless it
    has no text at all (a special token: after everything)."""
    offsets = []
    for j, token in enumerate(token_ids):
        before, after = texts[j], texts[j + 1]
        common = _lcp(before, after)
        if common < len(before):
            offset = common
        elif len(after) > len(before) or token in getattr(text_model, "special", ()):
            offset = len(before)
        else:
            offset = max(len(before) - 1, 0)
        # A pending character spelled one U+FFFD per byte (ByteFallback) starts where the
        # character it becomes does: no later than the text before it agrees with the last.
        offsets.append(min(offset, _lcp(before, texts[-1])))
    return _byte_run_offsets(offsets, token_ids, text_model)


def byte_runs(token_ids: list[int], byte_of: dict[int, int], special=()) -> list[list[int]]:
    """The positions of each run of byte-fallback tokens, as the decoder joins them: special
    tokens are skipped before decoding, so one between two byte tokens does not end a run."""
    runs: list[list[int]] = []
    current: list[int] = []
    for j, t in enumerate(token_ids):
        if t in byte_of:
            current.append(j)
        elif t not in special and current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def unsure_offsets(token_ids: list[int], text_model, stream: bool, texts=None) -> set[int]:
    """The tokens whose text_offset has no one answer: a special token inside a run of bytes
    or after text still changing (`texts`: a character still arriving; it has no text and sits
    between two bytes of one character); and in a stream, in a run that is not
    UTF-8 as a whole, a continuation byte after another non-ASCII byte: it may be the next
    byte of a character still arriving (its offset that character's) until a later byte
    shows the character never completes (then one U+FFFD per byte), after it was sent."""
    byte_of = getattr(text_model, "fallback_bytes", {})
    special = getattr(text_model, "special", ())
    unsure = set()
    if texts is not None:
        unsure = {
            j
            for j, t in enumerate(token_ids)
            if t in special and (texts[j].endswith(FFFD) or not texts[-1].startswith(texts[j]))
        }
    for run in byte_runs(token_ids, byte_of, special):
        unsure |= set(range(run[0], run[-1] + 1)) - set(run)
        data = bytes(byte_of[token_ids[j]] for j in run)
        if stream and not _is_utf8(data):
            unsure |= {
                run[p]
                for p in range(1, len(data))
                if 0x80 <= data[p] < 0xC0 and data[p - 1] >= 0x80
            }
    return unsure


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _byte_run_offsets(offsets: list[int], token_ids: list[int], text_model) -> list[int]:
    """Offsets inside runs of byte-fallback tokens, by the ByteFallback rule rather than from
    the texts after each token: the decoder reads a run as one buffer, so a run cut before a
    character's last byte decodes all of its bytes as U+FFFD (the texts say nothing about
    where a byte's character starts). A run is one UTF-8 text when it is valid as a whole
    (each byte starts where its character does), else one U+FFFD per byte; counted from where
    the run's first token starts."""
    byte_of = getattr(text_model, "fallback_bytes", {})
    out = list(offsets)
    for run in byte_runs(token_ids, byte_of, getattr(text_model, "special", ())):
        data = bytes(byte_of[token_ids[j]] for j in run)
        valid = _is_utf8(data)
        for p, j in enumerate(run):
            out[j] = offsets[run[0]] + (char_index(data, p) if valid else p)
    return out


@dataclass(frozen=True, slots=True)
class StopCut:
    tokens: int  # tokens reported: up to the one that completed the stop string
    chars: int  # the text's length: it ends where the stop string starts
    stop: str  # the stop string that ended it


def find_stop_in(texts: list[str], stops: list[str], limit: int | None = None) -> StopCut | None:
    """The first stop string to appear as the tokens arrive (texts[k]: the text after k
    tokens; the earliest-starting one when several complete on the same token). `limit`: only
    a stop string wholly within the text's first `limit` characters counts."""
    if not stops:
        return None
    for k in range(1, len(texts)):
        text = texts[k] if limit is None else texts[k][:limit]
        hits = sorted((text.find(s), s) for s in stops if s in text)
        if hits:
            return StopCut(k, hits[0][0], hits[0][1])
    return None


def find_stop(pieces: list[bytes], stops: list[str]) -> StopCut | None:
    """find_stop_in over raw byte pieces (the byte tokenizer's rule)."""
    return find_stop_in([decode(pieces[:k]) for k in range(len(pieces) + 1)], stops)


@dataclass(frozen=True, slots=True)
class TokenEntry:
    token_id: int
    text: str  # `tokens` / `token` spelling
    piece: object  # raw bytes (chat's `bytes`; None there when empty), or UNKNOWN
    logprob: float | None  # None: an echoed prompt's first token (nothing precedes it)
    top: dict[str, float] | None  # the k most likely tokens, by spelling (None: as logprob)
    top_bytes: dict[str, object]  # their raw bytes (chat's `bytes`)
    offset: int  # text_offset
    # Every token within the tolerance below the k-th (the top k among them), by spelling ->
    # (logprob, raw bytes): the tokens a top k may hold when logits tie (16-bit models).
    band: dict[str, tuple[float, object]] = field(default_factory=dict)
    offset_judged: bool = True  # False: past the stable text (its offset has no one answer)
    # Completions' keys (completion_keys): the chosen token's `tokens` spelling, its position's
    # `top_logprobs` (the top k and the chosen token) and band, keyed so no two tokens merge.
    key: str = ""
    keyed_top: dict[str, float] | None = None
    keyed_band: dict[str, tuple[float, object]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ExpectedChoice:
    index: int
    text: str
    finish_reason: str
    token_ids: list[int]
    entries: list[TokenEntry] | None  # None: no logprobs asked for
    stop: str | None  # the stop string that ended it, if one did
    # Unstable decode: the server's text must start with text[:stable]; the rest is not judged.
    stable: int | None = None
    # False: a stop string may have matched past the stable text, so the server may have ended
    # the choice earlier: its tokens must be a prefix of these, its finish_reason "stop" or this.
    tokens_exact: bool = True
    prefix_tokens: int = 0  # echo: the prompt's tokens at the start of token_ids and entries


def expected_choice(
    text_model,
    index: int,
    token_ids: list[int],
    step_logits: list[torch.Tensor],
    finish_reason: str,
    stops: list[str],
    num_logprobs: int | None,
    stream: bool = False,
    atol: float = 0.0,
    context: list[int] | tuple[int, ...] = (),
) -> ExpectedChoice:
    """The choice a server must return for the reference's tokens of one sample, after the
    prompt `context`. `stream`: a stream cannot take back what it sent, so the offsets of a
    stop string's tokens that came before the one completing it are where their text starts (a
    whole response says where the text ends, as for the tokens after it). `atol`: the logit
    tolerance, how far below the k-th logprob each entry's band reaches."""
    texts = choice_texts(text_model, list(context), token_ids)
    stable = stable_length(texts)
    cut = find_stop_in(texts, stops, stable)
    tokens_exact = True
    if cut is not None:
        token_ids, texts = token_ids[: cut.tokens], texts[: cut.tokens + 1]
        text, finish_reason, stable = texts[-1][: cut.chars], "stop", None
    else:
        text = texts[-1]
        tokens_exact = stable is None or not stops
    entries = None
    if num_logprobs is not None:
        sent = cut.tokens - 1 if stream and cut is not None else 0  # offsets already out
        unsure = unsure_offsets(token_ids, text_model, stream, texts)
        entries = _entries(
            text_model, token_ids, texts, step_logits, num_logprobs, len(text), sent, atol, stable
        )
        entries = [
            replace(e, offset_judged=False) if j in unsure else e for j, e in enumerate(entries)
        ]
    return ExpectedChoice(
        index,
        text,
        finish_reason,
        list(token_ids),
        entries,
        cut.stop if cut else None,
        stable,
        tokens_exact,
    )


def _offsets(text_model, token_ids, texts) -> list[int]:
    if isinstance(text_model, ByteText):
        pieces = token_pieces(text_model, token_ids)
        return text_offsets(pieces, len(decode(pieces)))
    return hf_offsets(texts, token_ids, text_model)


def _entries(tm, token_ids, texts, step_logits, k, text_len, sent, atol, stable):
    unclamped = _offsets(tm, token_ids, texts)
    offsets = [min(o, text_len) for o in unclamped]
    offsets[:sent] = unclamped[:sent]
    limit = texts[-1][: len(texts[-1]) if stable is None else stable]
    entries = []
    for j, (token, logits, offset) in enumerate(zip(token_ids, step_logits, offsets, strict=False)):
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (V,) the raw distribution
        top, top_bytes, band = {}, {}, {}
        ranked: list[tuple[float, int]] = []
        if k:
            values, ids = torch.topk(logprobs, k)
            for i, v in zip(ids.tolist(), values.tolist(), strict=True):
                top[tm.spell(i)], top_bytes[tm.spell(i)] = float(v), tm.raw(i)
            near = (logprobs >= float(values[-1]) - atol).nonzero()[:, 0].tolist()
            for i in near:
                band[tm.spell(i)] = (float(logprobs[i]), tm.raw(i))
            ranked = sorted(((float(logprobs[i]), i) for i in {*ids.tolist(), *near}), reverse=True)
        judged = _judged(stable, limit, texts[j + 1], unclamped[j])
        chosen = float(logprobs[token])
        entry = TokenEntry(
            token, tm.spell(token), tm.raw(token), chosen, top, top_bytes, offset, band, judged
        )
        entries.append(keyed_entry(tm, entry, ranked, k))
    return entries


def completion_keys(tm, ranked: list[int]) -> dict[int, str]:
    """Each token's key in a completions `top_logprobs` dict, `ranked` best first (the chosen
    token last): its spelling, unless a higher-ranked token has that spelling already, then
    `token_id:N`. A dict keyed by spelling alone would merge two distinct tokens (a byte-fallback
    `<0x61>` and the piece `a`), keeping one value for both."""
    names: dict[int, str] = {}
    for i in ranked:
        if i not in names:
            name = tm.spell(i)
            names[i] = f"token_id:{i}" if name in names.values() else name
    return names


def keyed_entry(tm, entry: TokenEntry, ranked: list[tuple[float, int]], k: int) -> TokenEntry:
    """`entry` with its completions keys, from `ranked` ((logprob, id) best first, at least
    the top k and the band) and the entry's own token."""
    if entry.logprob is None:
        return replace(entry, key=entry.text)
    names = completion_keys(tm, [i for _, i in ranked[:k]] + [entry.token_id])
    top = {names[i]: v for v, i in ranked[:k]}
    top.setdefault(names[entry.token_id], entry.logprob)
    # Where logits tie, another top k is the server's: its keys follow its own ranking.
    floor = min((b for b, _ in entry.band.values()), default=math.inf)
    in_band = [(v, i) for v, i in ranked if v >= floor]
    band_names = completion_keys(tm, [i for _, i in in_band] + [entry.token_id])
    band = {band_names[i]: (v, tm.raw(i)) for v, i in in_band}
    return replace(entry, key=names[entry.token_id], keyed_top=top, keyed_band=band)


def _judged(stable: int | None, limit: str, text_after: str, offset: int) -> bool:
    """Whether a token's offset has one answer: all of the text is stable, or the token starts
    within the stable text and the text after it agrees with that (past it, a server's text
    and offsets follow its own decode)."""
    return stable is None or (offset <= stable and limit.startswith(text_after.rstrip(FFFD)))


def prompt_entries(
    text_model, prompt_ids: list[int], rows: list[dict[int, float] | None], k: int, atol: float
) -> tuple[str, list[TokenEntry], int | None]:
    """Completions' echo: the prompt's text (decoded alone) and its entries — logprob and top
    None for the first token, then each row's top k (`rows`: the reference's prompt logprobs
    with at least k + a band's worth of entries) and the token's own; offsets in the prompt's
    text. Also how much of the text is stable (None: all)."""
    texts = choice_texts(text_model, [], prompt_ids)
    stable = stable_length(texts)
    offsets = _offsets(text_model, prompt_ids, texts)
    limit = texts[-1][: len(texts[-1]) if stable is None else stable]
    unsure = unsure_offsets(prompt_ids, text_model, False, texts)
    entries = []
    for j, (token, row, offset) in enumerate(zip(prompt_ids, rows, offsets, strict=True)):
        judged = _judged(stable, limit, texts[j + 1], offset) and j not in unsure
        spell, raw = text_model.spell(token), text_model.raw(token)
        if row is None:
            entry = TokenEntry(token, spell, raw, None, None, {}, offset, {}, judged)
            entries.append(replace(entry, key=spell))
            continue
        ranked = sorted(((v, i) for i, v in row.items()), reverse=True)
        top = {text_model.spell(i): v for v, i in ranked[:k]}
        top_bytes = {text_model.spell(i): text_model.raw(i) for v, i in ranked[:k]}
        kth = ranked[k - 1][0] if k and len(ranked) >= k else None
        band = {}
        if kth is not None:
            band = {
                text_model.spell(i): (v, text_model.raw(i)) for v, i in ranked if v >= kth - atol
            }
        entry = TokenEntry(token, spell, raw, row[token], top, top_bytes, offset, band, judged)
        entries.append(keyed_entry(text_model, entry, ranked, k))
    return texts[-1], entries, stable
