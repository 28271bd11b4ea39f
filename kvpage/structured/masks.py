"""The step's token masks: one bit per vocabulary id for every constrained row, filled by
llguidance's executor for all of them at once (in parallel, outside the GIL), then applied to
those rows' logits before the sampler reads them. Rows without a grammar are not touched."""

from __future__ import annotations

import llguidance
import llguidance.torch
import numpy as np
import torch

from kvpage.structured.matcher import GrammarMatcher


class TokenMasks:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor()
        self._bitmask = torch.empty(0, self.words, dtype=torch.int32)

    def allowed(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """(R, V) bool: True where matcher r allows the id next."""
        bitmask = self._buffer(len(matchers))
        pairs = [(m.matcher, i) for i, m in enumerate(matchers)]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
        return unpack(bitmask, self.vocab_size)

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]):
        """logits (M, V) -> a copy whose `rows` (one per matcher) keep only allowed ids (the
        others -inf); the input is left as it is (logprobs report the model's own)."""
        refused = ~self.allowed(matchers).to(logits.device)
        if rows != list(range(logits.shape[0])):  # free rows too: refuse nothing there
            full = refused.new_zeros(logits.shape)
            full[torch.tensor(rows, dtype=torch.long, device=logits.device)] = refused
            refused = full
        # one pass over the logits, writing the copy (a bool mask is a quarter of their bytes)
        return logits.masked_fill(refused, float("-inf"))

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._bitmask.shape[0] < rows:
            self._bitmask = torch.empty(rows, self.words, dtype=torch.int32)
        return self._bitmask[:rows]


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 words, bit j of word w = id 32w + j -> (R, vocab_size) bool. Little-endian:
    byte k of a word holds its bits 8k..8k+7."""
    octets = bitmask.contiguous().numpy().view(np.uint8)  # (R, 4W)
    # numpy's unpackbits: a quarter of the time of torch's shift-and-mask on 32 x 32000 ids
    bits = np.unpackbits(octets, axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)
