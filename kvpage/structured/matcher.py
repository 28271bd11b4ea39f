"""One sequence's grammar state: which tokens may come next, advanced by each appended token."""

from __future__ import annotations

import llguidance


class GrammarMatcher:
    """An llguidance matcher over one sequence's output tokens. `consumed` counts the tokens it
    has taken, so a replay can be checked against the output it must stand for."""

    def __init__(self, matcher: llguidance.LLMatcher, digest: str) -> None:
        self.matcher = matcher
        self.digest = digest  # the compiled grammar it runs (StructuredOutputsParams.digest)
        self.consumed = 0

    def advance(self, token: int) -> bool:
        """Take the sequence's next token; False when the grammar does not allow it (the
        matcher is then in its error state, `error` says why)."""
        if not self.matcher.consume_token(token):
            return False
        self.consumed += 1
        return True

    @property
    def finished(self) -> bool:
        """Nothing may follow: the grammar is complete (or only EOS could come)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def replay(self, tokens: list[int]) -> bool:
        """Back to the start, then every token of `tokens` again: the state a sequence whose
        KV is recomputed from its tokens stands in. False when one is refused."""
        self.matcher.reset()
        self.consumed = 0
        return all(self.advance(token) for token in tokens)

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (a parallel sample's own)."""
        twin = GrammarMatcher(self.matcher.deep_copy(), self.digest)
        twin.consumed = self.consumed
        return twin
