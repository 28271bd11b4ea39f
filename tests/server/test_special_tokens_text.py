"""`skip_special_tokens: false`: a choice's text with its special tokens spelled out, streamed
token by token exactly as the tokenizer's own decode (transformers, through AutoTokenizer) of
prompt + completion, less the prompt's, on a SentencePiece-style and a byte-level BPE
tokenizer; the server's field, and stop strings that see the special tokens' text."""

from __future__ import annotations

import random

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.model.tokenizer import ByteTokenizer, HFTokenizer, text_tokenizer
from kvpage.server import ServerOptions, create_app
from kvpage.server.text_stream import TextStream, prompt_context
from kvpage.verify.stack.tokenizer_dirs import build


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("special-dirs")
    return {kind: build(root / kind, kind) for kind in ("spm", "bpe")}


def _ours(directory) -> HFTokenizer:
    return HFTokenizer(directory / "tokenizer.json", 1, 2)


def _prefix_stable(theirs, prompt: list[int], completion: list[int]) -> bool:
    """Whether each longer decode extends the one before (less a character still arriving):
    only then has a stream one right text at every step (kvpage.verify.stack.text_oracle)."""
    texts = [
        theirs.decode(prompt + completion[:k], skip_special_tokens=False).rstrip("\ufffd")
        for k in range(len(completion) + 1)
    ]
    whole = theirs.decode(prompt + completion, skip_special_tokens=False)
    return all(whole.startswith(t) for t in texts)


@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_streamed_text_with_special_tokens_equals_the_tokenizers_decode(dirs, kind):
    theirs = AutoTokenizer.from_pretrained(dirs[kind])
    shown = text_tokenizer(_ours(dirs[kind]), skip_special_tokens=False)
    rng = random.Random(kind)
    specials = [0, 1, 2]  # <unk>/<|pad|>, BOS, EOS: special in both vocabularies
    judged = 0
    for _ in range(200):
        ids = [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(3, 320)]
        ids += [rng.choice(specials) if rng.random() < 0.15 else rng.randrange(3, 320)
                for _ in range(rng.randint(1, 24))]  # fmt: skip
        cut = rng.randint(1, len(ids) - 1)
        prompt, completion = ids[:cut], ids[cut:]
        stream = TextStream(shown, [], context=prompt_context(prompt, shown))
        text = "".join(stream.add([t], final=j == len(completion) - 1) for j, t in
                       enumerate(completion))  # fmt: skip
        whole = theirs.decode(prompt + completion, skip_special_tokens=False)
        head = theirs.decode(prompt, skip_special_tokens=False)
        if not _prefix_stable(theirs, prompt, completion):
            continue  # ByteFallback: a later invalid byte rewrites its run, sent or not
        judged += 1
        assert text == whole[len(head) :], (prompt, completion)
    assert judged > 100


def test_the_byte_tokenizer_has_no_text_for_its_special_tokens():
    tok = ByteTokenizer()
    assert text_tokenizer(tok, skip_special_tokens=False) is tok


@pytest.fixture(scope="module")
def bpe_client(dirs):
    engine = LLMEngine(EngineConfig(model=str(dirs["bpe"]), num_blocks=64))
    with TestClient(create_app(engine, ServerOptions(shadow_rate=0.0))) as client:
        yield client


def _completion(client, **body) -> dict:
    r = client.post("/v1/completions", json={"prompt": [1, 40, 50], "max_tokens": 48,
                                            "ignore_eos": True, "seed": 4, "temperature": 1.0,
                                            "return_token_ids": True, **body})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_the_server_spells_special_tokens_when_asked(bpe_client, dirs):
    """A completion forced through EOS (stop_token_ids empty, ignore_eos) shows "<|end_of_text|>" with
    skip_special_tokens false, and leaves it out by default; both as transformers decodes."""
    theirs = AutoTokenizer.from_pretrained(dirs["bpe"])
    shown = _completion(bpe_client, skip_special_tokens=False)
    hidden = _completion(bpe_client)
    assert shown["token_ids"] == hidden["token_ids"]  # the same draws; only the text differs
    assert {0, 1, 2} & set(shown["token_ids"]), "no special token drawn: pick another seed"
    assert "<" in shown["text"] and shown["text"] != hidden["text"]
    ids = [1, 40, 50] + shown["token_ids"]
    for choice, skip in ((shown, False), (hidden, True)):
        head = theirs.decode(ids[:3], skip_special_tokens=skip)
        assert choice["text"] == theirs.decode(ids, skip_special_tokens=skip)[len(head) :]


def test_spaces_between_special_tokens_is_accepted_either_way(bpe_client):
    """transformers' fast tokenizers take no such option: the text is the same."""
    a = _completion(bpe_client, skip_special_tokens=False, spaces_between_special_tokens=False)
    b = _completion(bpe_client, skip_special_tokens=False, spaces_between_special_tokens=True)
    assert a["text"] == b["text"]
