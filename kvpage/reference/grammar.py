"""The reference's own structured-output constraint: what a constrained request may emit next,
computed here and nowhere else the engine reaches. It compiles each constraint itself with
llguidance over a tokenizer it builds itself (a Hugging Face directory's tokenizer.json read
from disk; a built-in model's byte tokenizer by its definition: ids 0..255 are those bytes,
the rest have no text), and turns the matcher's bitmask into allowed ids with numpy. It
imports nothing of kvpage.structured or kvpage.engine: an oracle that shares the engine's
compiler, tokenizer table or mask code would repeat their bugs.

Semantics (vLLM's): the mask comes first, then greedy argmax or temperature, top-k and top-p
over the masked logits; the drawn token advances the matcher; a matcher that is stopped (the
grammar complete) ends the request with "stop"."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from kvpage.structured_params import StructuredOutputsParams

BYTE_VOCAB = 256  # the built-in tokenizer's text ids: one byte each
BUILTIN_PREFIX = "builtin:"


class ReferenceGrammars:
    """Constraints compiled over one model's vocabulary (`vocab_size` ids, the logits' width),
    each once per content digest; `matcher(params)` is a fresh matcher of its own."""

    def __init__(self, model_name: str, vocab_size: int, eos_token_ids) -> None:
        self.vocab_size = vocab_size
        self.eos = list(eos_token_ids)
        self.tokenizer = _lltokenizer(model_name, vocab_size, self.eos)
        self._compiled: dict[str, llguidance.LLMatcher] = {}

    def matcher(self, params: StructuredOutputsParams) -> ReferenceMatcher:
        compiled = self._compiled.get(params.digest)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar_of(params), log_level=0)
            if compiled.is_error():
                problem = compiled.get_error()
                raise ValueError(f"the reference cannot compile {params.kind}: {problem}")
            self._compiled[params.digest] = compiled
        return ReferenceMatcher(compiled.deep_copy(), self.vocab_size)

    def text(self, token_ids: list[int]) -> str:
        """The output's text by the reference's tokenizer (what the checker validates);
        special ids (EOS) have none."""
        text_ids = [t for t in token_ids if not self.tokenizer.is_special_token(t)]
        return self.tokenizer.decode_bytes(text_ids).decode("utf-8", errors="replace")


@dataclass(slots=True)
class ReferenceMatcher:
    matcher: llguidance.LLMatcher
    vocab_size: int

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the ids the grammar allows next."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype="<u4")
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def consume(self, token: int) -> bool:
        return bool(self.matcher.consume_token(token))

    @property
    def stopped(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(V,) logits with every id the grammar refuses at -inf (a copy)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar a constraint stands for, built here from the request's fields."""
    build = llguidance.LLMatcher
    whitespace = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.json is not None:
        return build.grammar_from_json_schema(params.json, whitespace)
    if params.json_object:
        return build.grammar_from_json_schema(json.dumps({"type": "object"}), whitespace)
    if params.regex is not None:
        return build.grammar_from_regex(params.regex)
    if params.choice is not None:
        literals = (json.dumps(choice, ensure_ascii=False) for choice in params.choice)
        return build.grammar_from_lark("start: " + " | ".join(literals))
    return build.grammar_from_lark(any_to_lark(params.grammar))


def _lltokenizer(model_name: str, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    directory = Path(model_name)
    if not model_name.startswith(BUILTIN_PREFIX) and (directory / "tokenizer.json").is_file():
        text = (directory / "tokenizer.json").read_text()
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos or None)
    table = _ByteDefinition(vocab_size, eos)
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(table), n_vocab=vocab_size, eos_token=eos or None
    )


class _ByteDefinition:
    """The built-in tokenizer as llguidance's TokenizerWrapper reads it, from its definition:
    ids below 256 are their byte, every other id is special (no text)."""

    def __init__(self, vocab_size: int, eos: list[int]) -> None:
        self.tokens = [
            bytes([i]) if i < BYTE_VOCAB else b"\xff<special_%d>" % i for i in range(vocab_size)
        ]
        self.special_token_ids = list(range(BYTE_VOCAB, vocab_size))
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = BYTE_VOCAB if vocab_size > BYTE_VOCAB else None

    def __call__(self, text: bytes) -> list[int]:
        return list(text)
