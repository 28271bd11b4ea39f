"""Prompt-logprob mutants: rows scored against the wrong position, a request that wants prompt
logprobs served a prefix hit whose rows are not kept (the hit's positions never get logits:
vLLM's bug of prompt logprobs that go wrong with cached prefixes), and the bugs of the row store
kept beside cached blocks (kvpage.engine.prompt_row_store): rows keyed without the namespace,
rows served after their block's generation changed, kept rows served one position off. Each
replaces a declared seam.

The row check (kvpage.verify.cases.prompt_logprobs.check_prompt_logprobs, run on every case)
catches wrong values and attributes them to prompt_logprobs. Rows from another namespace or from
a reused block can be numerically right (same tokens); KV provenance (kvpage.verify.provenance)
treats every served row set as a read of the block it was computed for, and finds them there.
An uncapped hit shows first as the case's expected cached tokens, a prefix_key finding."""

from __future__ import annotations

import hashlib
from array import array

import torch

from kvpage.engine.engine import LLMEngine
from kvpage.verify.mutants.base import mutant_table, plant


def rows_offset_by_one(engine: LLMEngine) -> None:
    """Row i is computed from the logits of position i + 1 (the next row)."""
    honest = engine.prompt_scorer.prompt_logprob_rows

    def rows(self, logits, token_ids, k):
        shifted = torch.cat([logits[1:], logits[-1:]]) if len(logits) > 1 else logits
        return honest(shifted, token_ids, k)

    plant(engine, "scorer.prompt_logprob_rows", rows)


def hit_for_prompt_rows(engine: LLMEngine) -> None:
    """The hit cap ignores prompt logprobs: a cached prefix is taken and its rows never scored."""
    plant(engine, "scheduler.prompt_hit_blocks", lambda self, seq: None)


def rows_keyed_without_namespace(engine: LLMEngine) -> None:
    """Kept rows keyed by the prefix's tokens alone: a tenant's hit is served rows another
    tenant's request computed (vLLM #3264's LoRA-less block hash, for rows)."""
    size = engine.config.block_size

    def key_of(self, seq, logical):
        tokens = array("q", seq.prompt_ids[: (logical + 1) * size]).tobytes()
        return hashlib.sha256(b"rows" + tokens).digest()

    plant(engine, "rows.key_of", key_of)


def rows_outlive_generation(engine: LLMEngine) -> None:
    """Kept rows are served whatever became of the block they were computed for."""
    plant(engine, "rows.is_live", lambda self, stored: True)


def kept_rows_offset_by_one(engine: LLMEngine) -> None:
    """A hit is served the kept row of the next position for each position."""
    honest = engine.scheduler.prompt_rows.rows_for

    def rows_for(self, seq, stored, logical, first, k):
        rows = honest(seq, stored, logical, first, k)
        return rows[1:] + rows[-1:]

    plant(engine, "rows.rows_for", rows_for)


PROMPT_LOGPROB_MUTANTS = mutant_table(
    "prefix_key",
    (
        (
            "prompt_rows_under_a_hit",
            "a prompt-logprob request takes a prefix hit; the hit's rows are never computed",
            hit_for_prompt_rows,
        ),
    ),
    suites=("prompt_logprobs",),
) + mutant_table(
    "prompt_logprobs",
    (
        (
            "prompt_rows_offset_by_one",
            "prompt logprob rows scored from the next position's logits",
            rows_offset_by_one,
        ),
        (
            "prompt_rows_from_another_namespace",
            "kept prompt rows keyed without the namespace: one tenant's hit gets another's rows",
            rows_keyed_without_namespace,
        ),
        (
            "prompt_rows_after_generation_change",
            "kept prompt rows served after the block they were computed for was reused",
            rows_outlive_generation,
        ),
        (
            "kept_prompt_rows_offset_by_one",
            "a hit's kept prompt rows served one position off",
            kept_rows_offset_by_one,
        ),
    ),
    suites=("prompt_logprobs",),
)
