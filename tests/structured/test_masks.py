"""The step's masks, against a bit-by-bit reading of llguidance's bitmask: unpack, and apply on
every row, on some rows (in any order), never touching the input or the free rows."""

from __future__ import annotations

import random

import torch

from kvpage.structured.masks import TokenMasks, unpack

VOCAB = 1000  # not a multiple of 32: the last word is partly padding


def _bit(word: int, j: int) -> bool:
    return bool((word >> j) & 1)


def test_unpack_reads_bit_j_of_word_w_as_id_32w_plus_j():
    gen = torch.Generator().manual_seed(0)
    words = (VOCAB + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    allowed = unpack(bitmask, VOCAB)
    assert allowed.shape == (3, VOCAB) and allowed.dtype == torch.bool
    expected = [[_bit(int(bitmask[r, i // 32]), i % 32) for i in range(VOCAB)] for r in range(3)]
    assert allowed.tolist() == expected


class _Fixed(TokenMasks):
    """Masks whose allowed ids are given (no grammar): apply's row handling alone."""

    def __init__(self, allowed: torch.Tensor) -> None:
        super().__init__(allowed.shape[1])
        self.fixed = allowed

    def allowed(self, matchers):
        return self.fixed[matchers]


def test_apply_masks_exactly_its_rows_and_copies():
    rng = random.Random(1)
    logits = torch.randn(6, VOCAB)
    before = logits.clone()
    allowed = torch.rand(6, VOCAB) < 0.3
    for rows in ([0, 1, 2, 3, 4, 5], [4, 1, 3], [5], [2, 0, 1, 3, 5, 4]):
        picks = [rng.randrange(6) for _ in rows]  # row rows[k] gets mask picks[k]
        masked = _Fixed(allowed).apply(logits, rows, picks)
        assert torch.equal(logits, before)  # the model's logits stay as they are
        expected = logits.clone()
        for row, pick in zip(rows, picks, strict=True):
            expected[row] = torch.where(allowed[pick], logits[row], float("-inf"))
        assert torch.equal(masked, expected), rows
