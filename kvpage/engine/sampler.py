"""One step's sampling: greedy rows in a single argmax; seeded rows each draw from their own
request's generator (kvpage.sampling), so a token never depends on its batch neighbours.

A parallel request (n > 1) is prefilled once, as sample 0; at its first token the sampler forks
it (the scheduler makes samples 1..n-1, kvpage.engine.scheduler.Scheduler.fork) and each new
sample draws its first token from the same logits row with its own generator."""

from __future__ import annotations

from typing import Protocol

import torch

from kvpage.engine.grammars import Grammars
from kvpage.engine.plan import Draw, Sampled, ScheduledSeq, Verified
from kvpage.engine.sequence import Sequence
from kvpage.engine.speculation import Speculation
from kvpage.sampling import chosen_logprobs, sample_token


class Forks(Protocol):
    """Who makes a parallel request's samples (the scheduler: they join its running queue)."""

    to_fork: set[int]  # seq ids of n > 1 requests before their first token

    def fork(self, parent: Sequence) -> list[Sequence]: ...


class Sampler:
    """The engine's sampling seam: one object per engine, so a mutant can replace `sample` on one
    instance without touching the module the reference also uses."""

    def __init__(
        self,
        forks: Forks,
        grammars: Grammars | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        self.forks = forks
        self.grammars = grammars
        self.speculation = speculation

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: (M, V), one row per sequence -> M token ids. A constrained row's grammar
        masks it first: greedy, temperature, top-k and top-p all see the masked row."""
        if self.grammars is not None:
            logits = self.grammars.mask_rows(logits, seqs)
        # One host sync for all greedy rows. max's indices are argmax's (the first maximum on a
        # tie, NaN's position where a row has one) at a third of its time on CPU: 0.25 vs
        # 0.74 ms for 32 rows of 32000 logits (argmax does not vectorise its reduction).
        tokens = torch.max(logits, dim=-1).indices.tolist()
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[row] = sample_token(logits[row], seq.params, seq.generator)
                seq.num_draws += 1
        return tokens

    def draw(self, sample_seqs: list[ScheduledSeq], logits: torch.Tensor) -> Sampled:
        """One draw per sampling row (logits (M, V), row i for sample_seqs[i]); a parallel
        request at its first token forks here, before its own draw is appended."""
        seqs = [item.seq for item in sample_seqs]
        tokens = self.sample(logits, seqs)
        forked: list[Draw] = []
        if self.forks.to_fork:  # empty unless a parallel request is before its first token
            for row, seq in enumerate(seqs):
                if seq.seq_id in self.forks.to_fork:
                    forked += self._fork(seq, row, logits[row])
        draws = [
            _draw(s, t, logits[r], r) for r, (s, t) in enumerate(zip(seqs, tokens, strict=True))
        ]
        return Sampled(draws, forked, logits)

    def verify(self, spec_seqs: list[ScheduledSeq], spec_logits: torch.Tensor) -> list[Verified]:
        """Each speculating sequence's verified tokens, as draws from its rows of spec_logits
        (sum of 1 + k, V): kept drafts then the target's own token, each with the logprobs of
        the row it stands at."""
        verifications = self.speculation.verify(spec_seqs, spec_logits)
        out = []
        first = 0
        for item, verification in zip(spec_seqs, verifications, strict=True):
            seq = item.seq
            draws = [
                _draw(seq, token, spec_logits[first + i], first + i)
                for i, token in enumerate(verification.tokens)
            ]
            out.append(Verified(item, draws, verification))
            first += item.num_new_tokens
        return out

    def _fork(self, parent: Sequence, row: int, logits_row: torch.Tensor) -> list[Draw]:
        draws = []
        for child in self.forks.fork(parent):
            token = self.sample(logits_row[None], [child])[0]  # the seam counts draws
            draws.append(_draw(child, token, logits_row, row, parent))
        return draws


def _draw(
    seq: Sequence, token: int, logits_row: torch.Tensor, row: int, parent: Sequence | None = None
) -> Draw:
    draw = Draw(seq, token, row=row, parent=parent)
    if seq.params.logprobs is not None:
        draw.top_logprobs, draw.logprob = chosen_logprobs(logits_row, seq.params.logprobs, token)
    return draw
