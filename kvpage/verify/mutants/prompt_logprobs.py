"""Prompt-logprob mutants: rows scored against the wrong position, and a request that wants
prompt logprobs served a prefix hit (the hit's positions never get logits: vLLM's bug of prompt
logprobs that go wrong with cached prefixes). Each replaces a declared seam.

The row check (kvpage.verify.cases.prompt_logprobs.check_prompt_logprobs, run on every case)
catches both and attributes them to prompt_logprobs; in the gate the hit shows first as the
case's expected cached tokens (0), a prefix_key finding.

The engine keeps no per-block row store (a request that wants rows takes no hit, so every row is
computed), so the bugs of such a store (rows from another namespace, rows outliving their
block's generation) have no seam to be planted in."""

from __future__ import annotations

import torch

from kvpage.engine.engine import LLMEngine
from kvpage.verify.mutants.base import Mutant, plant


def rows_offset_by_one(engine: LLMEngine) -> None:
    """Row i is computed from the logits of position i + 1 (the next row)."""
    honest = engine.prompt_logprob_rows

    def rows(self, logits, token_ids, k):
        shifted = torch.cat([logits[1:], logits[-1:]]) if len(logits) > 1 else logits
        return honest(shifted, token_ids, k)

    plant(engine, "engine.prompt_logprob_rows", rows)


def hit_for_prompt_rows(engine: LLMEngine) -> None:
    """The hit cap ignores prompt logprobs: a cached prefix is taken and its rows never scored."""
    plant(engine, "scheduler.prompt_hit_blocks", lambda self, seq: None)


PROMPT_LOGPROB_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "prompt_rows_under_a_hit",
        "a prompt-logprob request takes a prefix hit; the hit's rows are never computed",
        "prefix_key",
        hit_for_prompt_rows,
        suites=("prompt_logprobs",),
    ),
    Mutant(
        "prompt_rows_offset_by_one",
        "prompt logprob rows scored from the next position's logits",
        "prompt_logprobs",
        rows_offset_by_one,
        suites=("prompt_logprobs",),
    ),
)
