"""The prompts of bench/speculative.py: one stream, `prompt` tokens in, `output` tokens out.

  random    BOS + random ids: the draft-model rows (kvpage's int8 self-draft, llama.cpp's Q8_0
            draft) and both engines' plain decoding.
  grounded  the n-gram rows (prompt lookup): a prompt that holds the model's own continuation.
            The model has random weights, so a continuation is made, not written: the model's
            greedy output C for a prefix P (first run of the bench, untimed), then the prompt
            P + C[:m] + P, so that after the second P the lookup finds P's first occurrence and
            drafts C. Whether the model then says C again is its business: the acceptance rate
            is measured, never assumed.

Every id is >= FIRST_ID, the first id llama.cpp can be handed as text in its addressable GGUF
(bench/peers/llama_speculative.py), so both engines read the same ids. Pure Python: the tests
import it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

BOS = 1
FIRST_ID = 259  # bench/peers/llama_speculative.FIRST_CHAR_ID: 0-2 specials, 3-258 bytes


@dataclass(frozen=True, slots=True)
class Shape:
    prompt: int  # tokens in, BOS included
    output: int  # tokens out, EOS ignored


FULL = Shape(128, 256)
QUICK = Shape(32, 32)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str  # "random" | "grounded"
    prompt: list[int]
    max_tokens: int

    def as_json(self) -> dict:
        return {"name": self.name, "prompt": self.prompt, "max_tokens": self.max_tokens}


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """BOS, then length - 1 ids drawn from [FIRST_ID, vocab)."""
    if length < 1 or vocab <= FIRST_ID:
        raise ValueError(f"a prompt of {length} tokens from a vocabulary of {vocab}")
    return [BOS] + [rng.randrange(FIRST_ID, vocab) for _ in range(length - 1)]


def grounded_split(length: int) -> tuple[int, int]:
    """(len(P), m) of the layout P + C[:m] + P of `length` tokens: P a quarter, C the rest."""
    p = max(2, length // 4)
    m = length - 2 * p
    if m < 1:
        raise ValueError(f"a grounded prompt needs more than {2 * p} tokens, got {length}")
    return p, m


def grounded_prompt(prefix: list[int], continuation: list[int], length: int) -> list[int]:
    """prefix + continuation[:m] + prefix, `length` tokens: `continuation` is the model's greedy
    output for `prefix` alone (grounded_split gives len(prefix) and m)."""
    p, m = grounded_split(length)
    if len(prefix) != p or len(continuation) < m:
        raise ValueError(f"need a {p}-token prefix and >= {m} continuation tokens")
    return prefix + continuation[:m] + prefix


def make_random(seed: int, shape: Shape, vocab: int) -> Workload:
    rng = random.Random(f"{seed}:random")
    return Workload("random", random_prompt(rng, shape.prompt, vocab), shape.output)


def grounded_prefix(seed: int, shape: Shape, vocab: int) -> list[int]:
    """P: what the first, untimed run continues; its output grounds the prompt."""
    p, _ = grounded_split(shape.prompt)
    return random_prompt(random.Random(f"{seed}:grounded"), p, vocab)


def make_grounded(prefix: list[int], continuation: list[int], shape: Shape) -> Workload:
    return Workload("grounded", grounded_prompt(prefix, continuation, shape.prompt), shape.output)


def lookup_hits(prompt: list[int], output: list[int], n: int = 1) -> int:
    """How many output positions i have their n tokens before them (prompt + output[:i] tail)
    earlier in that history followed by output[i]: an upper bound on what prompt lookup with
    n-grams of n can ever accept, from the plain tokens alone (0 means no draft could match)."""
    history = list(prompt)
    hits = 0
    for token in output:
        tail = history[-n:]
        follows = {
            history[j + n]
            for j in range(len(history) - n)
            if history[j : j + n] == tail
        }  # fmt: skip
        hits += token in follows
        history.append(token)
    return hits
