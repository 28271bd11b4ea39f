"""Prompts the audit sends: fresh random token ids where the server takes them, else random
printable text (no tokenizer needed), and canaries that mark whose tokens are whose.

Fresh randomness per audit matters: a prompt nobody sent before is cold on any server, so its
first answer is a cache-free reference."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

_LETTERS = string.ascii_lowercase
_CANARY_CHARS = string.ascii_uppercase + string.digits
CANARY_TOKENS = 4  # canary length in ids (id mode)
CANARY_CHARS = 8  # canary length in characters (text mode)


@dataclass(frozen=True, slots=True)
class Prompt:
    """Token ids (exact lengths) or text (lengths estimated from the server's usage counts)."""

    ids: tuple[int, ...] | None = None
    text: str | None = None

    def __add__(self, other: Prompt) -> Prompt:
        if self.ids is not None and other.ids is not None:
            return Prompt(ids=self.ids + other.ids)
        return Prompt(text=(self.text or "") + (other.text or ""))

    @property
    def payload(self) -> list[int] | str:
        return list(self.ids) if self.ids is not None else (self.text or "")

    def describe(self) -> str:
        if self.ids is not None:
            return f"{len(self.ids)} token ids"
        return f"{len(self.text or '')} characters"


@dataclass(frozen=True, slots=True)
class Canary:
    """A marker only one request carries; seen in another request's output, it leaked."""

    owner: str  # the probe name it belongs to
    ids: tuple[int, ...] | None = None
    text: str | None = None

    @property
    def prompt(self) -> Prompt:
        return Prompt(ids=self.ids) if self.ids is not None else Prompt(text=f" {self.text}")


class PromptFactory:
    def __init__(
        self,
        seed: int,
        id_range: tuple[int, int] | None,
        chars_per_token: float = 1.0,
    ) -> None:
        self.rng = random.Random(seed)
        self.id_range = id_range  # None: text prompts
        self.chars_per_token = max(chars_per_token, 0.25)

    @property
    def mode(self) -> str:
        return "ids" if self.id_range is not None else "text"

    def random(self, n_tokens: int) -> Prompt:
        """About n_tokens of fresh random prompt (exactly, in id mode)."""
        if n_tokens <= 0:
            return Prompt(ids=()) if self.id_range is not None else Prompt(text="")
        if self.id_range is not None:
            lo, hi = self.id_range
            return Prompt(ids=tuple(self.rng.randrange(lo, hi) for _ in range(n_tokens)))
        return Prompt(text=self._words(round(n_tokens * self.chars_per_token)))

    def _words(self, n_chars: int) -> str:
        """Space-led random words, so two pieces concatenate at a word boundary."""
        out: list[str] = []
        size = 0
        while size < n_chars:
            word = " " + "".join(self.rng.choices(_LETTERS, k=self.rng.randint(2, 6)))
            out.append(word)
            size += len(word)
        return "".join(out)[: max(n_chars, 1)]

    def canary(self, owner: str) -> Canary:
        if self.id_range is not None:
            lo, hi = self.id_range
            return Canary(
                owner, ids=tuple(self.rng.randrange(lo, hi) for _ in range(CANARY_TOKENS))
            )
        return Canary(owner, text="".join(self.rng.choices(_CANARY_CHARS, k=CANARY_CHARS)))

    def salt(self) -> str:
        return f"kvpage-audit-{self.rng.getrandbits(64):016x}"
