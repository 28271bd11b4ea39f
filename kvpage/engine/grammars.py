"""The engine's structured outputs: a matcher per constrained sequence, the step's masks, and the
matcher's life beside the sequence's (kvpage.structured does the grammar work).

    add_request   matcher_for(params)      compiled once per content digest; a bad one raises
    sampler       mask_rows(logits, seqs)  constrained rows masked, before any sampling rule
    fork          fork(matcher)            each parallel sample its own copy
    update        the appended token advances the matcher; a finished grammar stops ("stop")
    recompute     replay(seq)              the matcher rebuilt from the sequence's output

Swap keeps the matcher as it is (the sequence's tokens do not change), and the prefix cache
never sees it: KV does not depend on the grammar. Its public methods are declared seams
(kvpage.engine.hooks)."""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC

import torch

from kvpage.engine.sequence import Sequence
from kvpage.errors import InvalidRequest
from kvpage.model.tokenizer import Tokenizer
from kvpage.sampling_params import SamplingParams
from kvpage.structured import GrammarCompiler, GrammarMatcher, TokenMasks, grammar_tokenizer


class Grammars:
    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: SequenceABC[int]
    ) -> None:
        self._tokenizer, self._eos = tokenizer, tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None  # built at the first constrained request
        self._masks: TokenMasks | None = None
        self.masked_steps = 0  # steps whose batch had a constrained row
        self.mask_ns = 0  # the time those steps spent masking

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self._tokenizer is None:
                raise InvalidRequest(
                    "structured outputs need the model's tokenizer; this engine has none"
                )
            tokenizer = grammar_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            self._compiler = GrammarCompiler(tokenizer)
            self._masks = TokenMasks(self.vocab_size)
        return self._compiler

    def matcher_for(self, params: SamplingParams) -> GrammarMatcher | None:
        """The new request's matcher (None without a constraint); InvalidRequest when its
        constraint does not compile."""
        if params.structured_outputs is None:
            return None
        return self.compiler.matcher(params.structured_outputs)

    def mask_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits (M, V), row i for seqs[i] -> the logits the sampler draws from: each
        constrained row keeps only the ids its grammar allows next. Unconstrained rows (and
        a batch without a constraint: the same tensor back) are untouched."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return logits
        start = time.perf_counter_ns()
        masked = self._masks.apply(logits, rows, [seqs[i].grammar for i in rows])
        self.mask_ns += time.perf_counter_ns() - start
        self.masked_steps += 1
        return masked

    def fork(self, matcher: GrammarMatcher | None) -> GrammarMatcher | None:
        """A parallel sample's matcher: a copy of its parent's, made before the parent's first
        token advances it."""
        return None if matcher is None else matcher.copy()

    def replay(self, seq: Sequence) -> None:
        """A sequence preempted by recompute: its matcher stands for its output again, rebuilt
        from the tokens (as its KV is)."""
        if seq.grammar is not None and not seq.grammar.replay(seq.output_ids):
            raise RuntimeError(f"{seq.sample_id}: its own output no longer matches its grammar")

    def stats(self) -> dict[str, int]:
        """Compiles and cache hits; the steps that masked rows and the microseconds they took
        (a constrained batch's own cost, what bench/structured.py reports)."""
        compiler = self._compiler
        return {
            "grammar_compiles": 0 if compiler is None else compiler.compiles,
            "grammar_cache_hits": 0 if compiler is None else compiler.hits,
            "grammar_masked_steps": self.masked_steps,
            "grammar_mask_us": self.mask_ns // 1000,
        }
