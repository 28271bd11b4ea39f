"""StructuredOutputsParams -> a grammar llguidance runs, compiled once per content digest: a
second request with the same schema copies the compiled matcher instead of compiling again.
A constraint llguidance cannot compile (a bad regex, an unknown schema keyword or format, a
grammar that does not parse) is an InvalidRequest naming the field, before the request queues."""

from __future__ import annotations

import json
from collections import OrderedDict

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from kvpage.errors import InvalidRequest
from kvpage.structured.matcher import GrammarMatcher
from kvpage.structured_params import StructuredOutputsParams

# Compiled grammars kept (least recently used dropped first): a server sees few distinct schemas.
CACHE_SIZE = 256


class GrammarCompiler:
    def __init__(self, tokenizer: llguidance.LLTokenizer, cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses)
        self.hits = 0

    def cache_key(self, params: StructuredOutputsParams) -> str:
        """What a compiled grammar is found by: the constraint's content (its digest), never
        the name a client gave its schema."""
        return params.digest

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar, from the cache or compiled now."""
        key = self.cache_key(params)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(params)
            self._compiled[key] = compiled
            self.compiles += 1
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self.hits += 1
            self._compiled.move_to_end(key)
        return GrammarMatcher(compiled.deep_copy(), params.digest)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = grammar_text(params)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"structured_outputs.{params.kind}: {matcher.get_error()}")
        return matcher


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) a constraint stands for."""
    kind, matcher = params.kind, llguidance.LLMatcher
    whitespace = {"whitespace_flexible": not params.disable_any_whitespace}
    if kind == "json":
        return _checked(kind, lambda: matcher.grammar_from_json_schema(params.json, whitespace))
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', whitespace)
    if kind == "regex":
        return _checked(kind, lambda: matcher.grammar_from_regex(params.regex))
    if kind == "choice":  # Lark string literals take JSON's escapes
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return matcher.grammar_from_lark(lark)
    return _checked(kind, lambda: matcher.grammar_from_lark(_lark(params.grammar)))


def _lark(grammar: str) -> str:
    """Lark as it is; GBNF (llama.cpp's, `root ::= ...`) translated."""
    try:
        return any_to_lark(grammar)
    except GbnfToLarkError as err:
        raise InvalidRequest(f"structured_outputs.grammar: {err}") from None


def _checked(kind: str, build) -> str:
    """The grammar `build` makes, validated: its first error is the request's."""
    try:
        grammar = build()
    except InvalidRequest:  # already names its field (a GBNF that does not translate)
        raise
    except (ValueError, RuntimeError, TypeError) as err:
        raise InvalidRequest(f"structured_outputs.{kind}: {err}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(f"structured_outputs.{kind}: {error}")
    return grammar
