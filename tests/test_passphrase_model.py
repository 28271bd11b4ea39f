"""The shipped passphrase model: its shape, the task format, and greedy recall of held-out
secrets through the contiguous reference generator."""

from __future__ import annotations

import importlib.util
import random

import pytest

from kvpage.errors import InvalidRequest
from kvpage.model import load_model
from kvpage.model.builtin import SHIPPED_MODELS, builtin_names
from kvpage.model.passphrase import (
    PREFIX,
    make_prompt,
    parse_answer,
    prompt_ids,
    random_secret,
    secret_offset,
)
from kvpage.model.tokenizer import ByteTokenizer
from kvpage.reference.generator import generate
from kvpage.sampling_params import SamplingParams

MODEL_DIR = SHIPPED_MODELS["passphrase-mini"]
NUM_RECALL = 100
GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def passphrase_model():
    return load_model("builtin:passphrase-mini")


def heldout(n: int) -> list[str]:
    secrets = (MODEL_DIR / "heldout_secrets.txt").read_text().split()
    assert len(secrets) >= n
    return secrets[:n]


def recall(model, tok, secret: str) -> str:
    return parse_answer(tok, generate(model, prompt_ids(tok, secret), GREEDY).token_ids)


def test_registered_and_shaped_as_specified(passphrase_model):
    model, tok = passphrase_model
    cfg = model.config
    assert "builtin:passphrase-mini" in builtin_names()
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (4, 128, 4, 4)
    assert cfg.vocab_size == tok.vocab_size == 258
    assert cfg.bos_token_id == 256 and cfg.eos_token_ids == (257,)
    assert sorted(p.name for p in MODEL_DIR.iterdir() if p.suffix in {".json", ".safetensors"}) == [
        "config.json",
        "model.safetensors",
    ]


def test_prompt_format_puts_the_secret_inside_a_partial_block():
    tok = ByteTokenizer()
    assert len(PREFIX.encode()) == 49 and secret_offset(tok) == 50
    assert secret_offset(tok) % 16 == 2  # 3 full prefix blocks, the secret in the 4th
    ids = prompt_ids(tok, "Ab3xY9")
    assert ids[0] == 256 and bytes(ids[50:56]) == b"Ab3xY9"
    assert tok.decode(ids) == make_prompt("Ab3xY9")
    assert parse_answer(tok, [*b"Ab3xY9", 257, *b"junk"]) == "Ab3xY9"
    assert parse_answer(tok, [*b"noeos"]) == "noeos"
    with pytest.raises(InvalidRequest):
        make_prompt("has space")
    lengths = {len(random_secret(random.Random(i))) for i in range(200)}
    assert lengths == set(range(6, 11))


def test_greedy_recall_of_heldout_secrets(passphrase_model):
    model, tok = passphrase_model
    wrong = {s: got for s in heldout(NUM_RECALL) if (got := recall(model, tok, s)) != s}
    assert wrong == {}


def test_recall_reads_the_prompt_not_a_memorized_answer(passphrase_model):
    model, tok = passphrase_model
    a, b = heldout(2)
    assert recall(model, tok, a) == a and recall(model, tok, b) == b
    assert recall(model, tok, a) != b  # a mismatch the recall test would report


def test_shipped_heldout_secrets_match_the_training_script():
    pytest.importorskip("transformers")  # train.py trains with it
    spec = importlib.util.spec_from_file_location("passphrase_train", MODEL_DIR / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    assert heldout(500) == train.heldout_secrets(500)
