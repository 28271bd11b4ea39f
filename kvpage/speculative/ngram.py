"""N-gram prompt lookup (vLLM's `ngram` method): draft the tokens that followed an earlier
occurrence of the history's own tail. No model, so drafts cost only a search of the history."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpage.errors import InvalidConfig
from kvpage.speculative.config import SpeculativeConfig


class NgramProposer:
    """vLLM's semantics: the longest n in [prompt_lookup_min, prompt_lookup_max] whose last-n
    tokens occur earlier in the history (the occurrence may overlap the tail, but must end before
    the last token so at least one token follows it); of that n's occurrences, the earliest. The
    draft is up to k tokens that followed it, fewer where the history ends; [] when none match.

    Cost per call: one vectorized comparison of the whole history with its last token (O(L) in
    numpy), then at most prompt_lookup_max - 1 comparisons over the surviving candidates only
    (usually a handful). A Python list is first copied into an array, O(L) too: pass an int
    ndarray to skip it. At L = 4096: ~11 us from an ndarray, ~75-85 us from a list (one core)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method != "ngram":
            raise InvalidConfig(f"NgramProposer needs method 'ngram', got {config.method!r}")
        self.k = config.num_speculative_tokens
        self.min_n: int = config.prompt_lookup_min  # type: ignore[assignment]  # resolved for ngram
        self.max_n: int = config.prompt_lookup_max  # type: ignore[assignment]

    def propose(self, token_ids: Sequence[int] | np.ndarray, limit: int | None = None) -> list[int]:
        """Drafts for a sequence whose tokens so far are `token_ids`. `limit` caps the count
        further (the room left before max_model_len or max_tokens, as vLLM caps at max_model_len)."""
        k = self.k if limit is None else min(self.k, limit)
        history = np.asarray(token_ids)
        if k <= 0 or len(history) <= self.min_n:  # an earlier n-gram needs n + 1 tokens
            return []
        n, end = self._longest_earliest_match(history)
        if n < self.min_n:
            return []
        return history[end + 1 : end + 1 + k].tolist()

    def _longest_earliest_match(self, history: np.ndarray) -> tuple[int, int]:
        """(n, end): the longest n <= max_n such that history[end - n + 1 : end + 1] equals the
        last n tokens for some end <= L - 2, and the smallest such end; (0, -1) if none."""
        last = len(history) - 1
        # ends[i]: an occurrence's last index; it survives step d while its d+1 tokens match.
        ends = np.flatnonzero(history[:last] == history[last])
        n, earliest = 0, -1
        for d in range(min(self.max_n, last)):
            if d:
                ends = ends[ends >= d]  # the occurrence would start before the history
                ends = ends[history[ends - d] == history[last - d]]
            if len(ends) == 0:
                break
            n, earliest = d + 1, int(ends[0])  # ends stays sorted: [0] is the earliest
        return n, earliest
