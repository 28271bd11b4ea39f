"""The tokenizer llguidance computes masks over: every id of the model's logits row and the bytes
it stands for. A Hugging Face tokenizer goes whole (its tokenizer.json); any other (the built-in
byte tokenizer) goes as the byte string of each id, special ids marked as llguidance wants (a
leading 0xff: they never match grammar text)."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance

from kvpage.model.tokenizer import Tokenizer


def grammar_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """`vocab_size` is the logits row's width (a model may pad past the tokenizer's ids: those
    ids are never allowed); the EOS ids end an accepting grammar."""
    eos = list(eos_token_ids) or None
    tokenizer_json = getattr(tokenizer, "tokenizer_json", None)
    if tokenizer_json is not None:
        return llguidance.LLTokenizer(tokenizer_json(), n_vocab=vocab_size, eos_token=eos)
    wrapper = llguidance.TokenizerWrapper(_ByteTable(tokenizer, vocab_size, eos))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


class _ByteTable:
    """What llguidance.TokenizerWrapper reads: per id its bytes, the special ids, and how to
    tokenize bytes (it asks when it forces text)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos: list[int] | None) -> None:
        self._tokenizer = tokenizer
        pieces = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        self.tokens = [b"\xff<special_%d>" % i if p is None else p for i, p in enumerate(pieces)]
        self.special_token_ids = [i for i, p in enumerate(pieces) if p is None]
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"), False)
