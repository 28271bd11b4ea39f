"""Prompt logprobs (vLLM's `prompt_logprobs`): the step's prompt rows' logits scored against the
prompt token each row predicts, appended to their sequence (kvpage.engine.plan.PromptRows says
which rows; kvpage.engine.prompt_row_store keeps scored rows for prefix hits)."""

from __future__ import annotations

import torch

from kvpage.engine.plan import PromptRows


class PromptScorer:
    """The engine's prompt-logprob seam: one object per engine, so a mutant can replace
    `prompt_logprob_rows` on one instance."""

    def score(self, prompt_rows: list[PromptRows], logits: torch.Tensor) -> None:
        """`logits` (sum of counts, V) holds the rows of `prompt_rows`, in order."""
        at = 0
        for rows in prompt_rows:
            seq, p = rows.seq, rows.first_position
            scored = seq.prompt_ids[p + 1 : p + 1 + rows.count]
            seq.prompt_logprobs += self.prompt_logprob_rows(
                logits[at : at + rows.count], scored, seq.params.prompt_logprobs
            )
            at += rows.count

    def prompt_logprob_rows(
        self, logits: torch.Tensor, token_ids: list[int], k: int
    ) -> list[dict[int, float]]:
        """Row i of `logits` (R, V) scores token_ids[i] (the prompt token after its position):
        the top k and that token itself, k + 1 entries when it is outside the top k (vLLM's
        prompt_logprobs). A declared seam (kvpage.engine.hooks)."""
        logprobs = torch.log_softmax(logits, dim=-1)  # (R, V)
        ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
        if k:
            top_vals, top_ids = torch.topk(logprobs, k, dim=-1)
            tops = zip(top_ids.tolist(), top_vals.tolist(), strict=True)
        else:
            tops = (([], []) for _ in token_ids)
        rows = []
        for token, lp, (t_ids, t_vals) in zip(token_ids, chosen, tops, strict=True):
            row = dict(zip(t_ids, t_vals, strict=True))
            row[token] = lp
            rows.append(row)
        return rows
