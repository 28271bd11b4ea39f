"""One step's sampling: greedy rows in a single argmax; seeded rows each draw from their own
request's generator (kvpage.sampling), so a token never depends on its batch neighbours."""

from __future__ import annotations

import torch

from kvpage.engine.sequence import Sequence
from kvpage.sampling import sample_token


class Sampler:
    """The engine's sampling seam: one object per engine, so a mutant can replace it on one
    instance without touching the module the reference also uses."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: (M, V), one row per sequence -> M token ids."""
        # One host sync for all greedy rows. max's indices are argmax's (the first maximum on a
        # tie, NaN's position where a row has one) at a third of its time on CPU: 0.25 vs
        # 0.74 ms for 32 rows of 32000 logits (argmax does not vectorise its reduction).
        tokens = torch.max(logits, dim=-1).indices.tolist()
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[row] = sample_token(logits[row], seq.params, seq.generator)
                seq.num_draws += 1
        return tokens
