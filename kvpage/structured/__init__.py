"""Constrained decoding on llguidance: a request's StructuredOutputsParams compiled once per
content digest (compiler), one matcher per sequence (matcher), and the step's token masks for
every constrained row at once (masks). The engine's wiring is kvpage.engine.grammars."""

from kvpage.structured.compiler import GrammarCompiler
from kvpage.structured.masks import TokenMasks
from kvpage.structured.matcher import GrammarMatcher
from kvpage.structured.tokenizer import grammar_tokenizer

__all__ = ["GrammarCompiler", "GrammarMatcher", "TokenMasks", "grammar_tokenizer"]
