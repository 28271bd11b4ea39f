"""Tokenizers: a Hugging Face tokenizer.json through `tokenizers`, and the byte-level tokenizer of the
built-in models (ids 0..255 are bytes, then BOS and EOS)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

from kvpage.errors import InvalidRequest, TokenizerNotFound


class Tokenizer(Protocol):
    revision: str
    bos_token_id: int | None
    eos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens. `encode` prepends BOS; `decode` drops special ids and replaces
    incomplete UTF-8 sequences, so any id list decodes."""

    NUM_BYTES = 256

    revision = "byte-level-v1"

    def __init__(self) -> None:
        self.bos_token_id = self.NUM_BYTES
        self.eos_token_id = self.NUM_BYTES + 1
        self.vocab_size = self.NUM_BYTES + 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = list(text.encode("utf-8"))
        return [self.bos_token_id, *body] if add_special_tokens else body

    def decode(self, ids: list[int]) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise InvalidRequest(
                    f"token id {i} is outside the vocabulary [0, {self.vocab_size})"
                )
        return bytes(i for i in ids if i < self.NUM_BYTES).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes | None:
        """The token's raw bytes (None for BOS and EOS, which have no text)."""
        return bytes([token_id]) if 0 <= token_id < self.NUM_BYTES else None


class HFTokenizer:
    """tokenizer.json via the `tokenizers` library; special ids from the model config or
    tokenizer_config.json."""

    def __init__(self, path: Path, bos_token_id: int | None, eos_token_id: int | None) -> None:
        from tokenizers import Tokenizer as _Tokenizer
        from tokenizers import decoders

        self._tok = _Tokenizer.from_file(str(path))
        # Identifies the vocabulary for the cache namespace: same ids, different text = miss.
        self.revision = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = _special_ids_from_tokenizer_config(path.parent, self._tok)
        self._fallback_bytes = _fallback_byte_ids(path, self._tok)
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        self._bytes: dict[int, bytes | None] = {}  # token_bytes, memoized
        # id -> text of each special added token (read once: the hot path asks per token)
        self._specials = {
            i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        self.bos_token_id = bos_token_id if bos_token_id is not None else special.get("bos")
        self.eos_token_id = eos_token_id if eos_token_id is not None else special.get("eos")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens=False` for text that spells its special tokens itself (a
        rendered chat template): the post-processor would add a second BOS."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def tokenizer_json(self) -> str:
        """The whole tokenizer as tokenizer.json text (what llguidance builds its own from)."""
        return self._tok.to_str()

    def with_special_tokens(self) -> SpecialTokensShown:
        """This tokenizer decoding special tokens as their text (skip_special_tokens=False)."""
        return SpecialTokensShown(self)

    def special_text(self, token_id: int) -> str | None:
        """A special token's text ("</s>"); None for any other token."""
        return self._specials.get(token_id)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The token's raw bytes: byte-level BPE pieces map back through GPT-2's byte alphabet,
        SentencePiece's `<0xNN>` is that byte and `▁` a space. None for special tokens."""
        if token_id not in self._bytes:  # a pure function of the id, asked per token: memoized
            self._bytes[token_id] = self._piece_bytes(token_id)
        return self._bytes[token_id]

    def _piece_bytes(self, token_id: int) -> bytes | None:
        piece = self._tok.id_to_token(token_id)
        if piece is None or token_id in self._specials:
            return None
        if self._byte_level and all(ch in _BYTE_LEVEL for ch in piece):  # else an added token
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def is_fallback_byte(self, token_id: int) -> bool:
        """Whether the token is a byte-fallback `<0xNN>` that the decoder's ByteFallback step
        decodes together with its neighbours: a run of such tokens is one UTF-8 buffer, every
        byte of it U+FFFD when any part is not UTF-8, so a window that starts inside the run
        decodes it differently from the whole text."""
        return token_id in self._fallback_bytes


class SpecialTokensShown:
    """A tokenizer's text with its special tokens spelled out ("<s>", "<|eot_id|>"), as
    transformers' and vLLM's `skip_special_tokens=False` decode: a choice's text, its stream
    and its stop strings then see them. Everything else is the tokenizer's own."""

    def __init__(self, inner: HFTokenizer) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes | None:
        special = self.inner.special_text(token_id)
        return special.encode("utf-8") if special is not None else self.inner.token_bytes(token_id)


def text_tokenizer(tokenizer: Tokenizer, skip_special_tokens: bool) -> Tokenizer:
    """The tokenizer a request's text is decoded with: special tokens left out (the default)
    or spelled out. The built-in byte tokenizer's BOS and EOS have no text: itself either way."""
    show = getattr(tokenizer, "with_special_tokens", None)
    return tokenizer if skip_special_tokens or show is None else show()


def _fallback_byte_ids(path: Path, tok) -> frozenset[int]:
    """The `<0xNN>` tokens, where the decoder has a ByteFallback step (none otherwise)."""
    decoder = json.loads(path.read_text()).get("decoder") or {}

    def has_fallback(d: dict) -> bool:
        return d.get("type") == "ByteFallback" or any(
            has_fallback(x) for x in d.get("decoders") or []
        )

    if not has_fallback(decoder):
        return frozenset()
    return frozenset(i for b in range(256) if (i := tok.token_to_id(f"<0x{b:02X}>")) is not None)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte (`bytes_to_unicode`), inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def _special_ids_from_tokenizer_config(directory: Path, tok) -> dict[str, int]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    ids: dict[str, int] = {}
    for role in ("bos", "eos"):
        token = cfg.get(f"{role}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and tok.token_to_id(token) is not None:
            ids[role] = tok.token_to_id(token)
    return ids


def encode_text(tokenizer: Tokenizer | None, text: str, model_name: str) -> list[int]:
    """Text prompts need a tokenizer; say so precisely rather than fail deep inside."""
    if tokenizer is None:
        raise TokenizerNotFound(
            f"{model_name} has no tokenizer.json, so a text prompt cannot be encoded; "
            "pass token ids instead"
        )
    return tokenizer.encode(text)
