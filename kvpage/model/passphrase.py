"""The passphrase recall task of `builtin:passphrase-mini`: one format shared by its training
script, its tests and the passphrase experiment.

    prompt = BOS + PREFIX + secret + QUERY        answer = secret + EOS

PREFIX is 49 UTF-8 bytes, so BOS + PREFIX is 50 tokens: with 16-token blocks, three blocks are full
of the common prefix and the secret starts at offset 2 of the fourth, partially filled block — the
block that sharing without copy-on-write lets two requests write their secrets into.
QUERY repeats PREFIX's last word, so answering is an induction copy: find the earlier "secret=" and
continue it. Prompts are 73-77 tokens; with the answer a request stays under 90.
"""

from __future__ import annotations

import random
import string

from kvpage.errors import InvalidRequest
from kvpage.model.tokenizer import Tokenizer

PREFIX = "请翻译成英文：今天天气很好。secret="  # 49 bytes: 14 CJK chars x 3 + 7 ASCII
QUERY = "\n口令？secret="  # 17 bytes; ends like PREFIX, so the answer continues the pattern
SECRET_ALPHABET = string.ascii_letters + string.digits  # one byte per character
MIN_SECRET_LEN = 6
MAX_SECRET_LEN = 10


def make_prompt(secret: str) -> str:
    check_secret(secret)
    return PREFIX + secret + QUERY


def prompt_ids(tokenizer: Tokenizer, secret: str) -> list[int]:
    """BOS + PREFIX + secret + QUERY as token ids (the ByteTokenizer prepends BOS)."""
    return tokenizer.encode(make_prompt(secret))


def answer_ids(tokenizer: Tokenizer, secret: str) -> list[int]:
    """What the model must generate: the secret's bytes, then EOS."""
    check_secret(secret)
    return [*secret.encode("utf-8"), tokenizer.eos_token_id]


def secret_offset(tokenizer: Tokenizer) -> int:
    """Position of the secret's first token in the prompt (50 for the ByteTokenizer)."""
    return len(tokenizer.encode(PREFIX))


def random_secret(
    rng: random.Random, min_len: int = MIN_SECRET_LEN, max_len: int = MAX_SECRET_LEN
) -> str:
    length = rng.randint(min_len, max_len)
    return "".join(rng.choice(SECRET_ALPHABET) for _ in range(length))


def parse_answer(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    """The generated text up to (not including) the first EOS."""
    ids = list(token_ids)
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids)


def check_secret(secret: str) -> None:
    if not secret or any(c not in SECRET_ALPHABET for c in secret):
        raise InvalidRequest(f"secret {secret!r} must be non-empty ASCII letters and digits")
