"""Stop strings and incremental detokenisation: limits on the request, a cost per token that does
not grow with the output, and text that stays exact across split characters and tokenizers."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvpage.model.tokenizer import ByteTokenizer, HFTokenizer
from kvpage.server.text_stream import TextStream

from .conftest import MODEL

BYTES = ByteTokenizer()


class CountingTokenizer:
    """A tokenizer that counts how many token ids it has been asked to decode."""

    def __init__(self, inner) -> None:
        self.inner, self.decoded = inner, 0
        self.vocab_size, self.eos_token_id = inner.vocab_size, inner.eos_token_id

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids)


def _stream_one_by_one(stream: TextStream, ids: list[int]) -> list[str]:
    pieces = [stream.add([t], final=False) for t in ids[:-1]]
    return [*pieces, stream.add(ids[-1:], final=True)]


def _hf_tokenizer(tmp_path, kind: str) -> HFTokenizer:
    if kind == "byte-bpe":  # GPT-2 style: a character outside the merges is several byte tokens
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator(["hello world, the cat sat on the mat"] * 20, trainer)
    else:  # SentencePiece style: a word's leading space is dropped at the start of a text
        vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁a": 3, "b": 4}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path / "tokenizer.json", None, None)


# --- incremental detokenisation --------------------------------------------------------------
def test_decoding_work_per_token_is_bounded():
    """Re-decoding the whole output on every token is quadratic; the window is a few tokens."""
    tok = CountingTokenizer(BYTES)
    ids = list(("naïve café 世界 🙂 " * 300).encode())  # ~7000 tokens, characters split
    stream = TextStream(tok, stop=["STOP", "\n\n"])
    assert "".join(_stream_one_by_one(stream, ids)) == BYTES.decode(ids)
    assert tok.decoded <= 12 * len(ids)


def test_split_characters_are_held_until_complete():
    stream = TextStream(BYTES)
    pieces = _stream_one_by_one(stream, list("a🙂b世".encode()))
    assert "".join(pieces) == "a🙂b世" and all("\ufffd" not in p for p in pieces)
    assert pieces[1:5] == ["", "", "", "🙂"]


def test_bytes_that_never_form_a_character_are_not_held_forever():
    stream = TextStream(BYTES)
    sent = "".join(stream.add([0xFF], final=False) for _ in range(20))
    assert sent.count("\ufffd") >= 10  # let go after a few tokens, not at the end
    assert sent + stream.add(list("é".encode()), final=True) == BYTES.decode([0xFF] * 20) + "é"


def test_invalid_bytes_then_a_split_character():
    ids = [0xFF] * 9 + list("🙂".encode()) + [ord("x")]
    stream = TextStream(BYTES)
    assert "".join(_stream_one_by_one(stream, ids)) == BYTES.decode(ids)


@pytest.mark.parametrize("kind", ["byte-bpe", "metaspace"])
def test_hf_tokenizers_stream_the_whole_decode(tmp_path, kind):
    tok = _hf_tokenizer(tmp_path, kind)
    text = "hello world, 世界 the cat 🙂 sat" if kind == "byte-bpe" else "hello world a b hello"
    ids = tok.encode(text)
    if kind == "byte-bpe":
        assert len(ids) > len(text.split())  # the CJK and emoji characters are byte tokens
    stream = TextStream(tok)
    pieces = _stream_one_by_one(stream, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


# --- stop strings ----------------------------------------------------------------------------
def test_stop_string_after_split_characters():
    stream = TextStream(BYTES, stop=["é!"])
    pieces = _stream_one_by_one(stream, list("日本é語é!rest".encode()))
    assert "".join(pieces) == "日本é語" and stream.stopped and stream.text == "日本é語"


def test_earliest_stop_string_wins_and_the_held_tail_is_bounded():
    stream = TextStream(BYTES, stop=["longer stop", "op"])
    for b in b"a longer st":
        stream.add([b], final=False)
        assert len(stream.held) < len("longer stop")
    stream.add(list(b"op here"), final=False)
    assert stream.stopped and stream.text == "a "  # "longer stop" starts before "op"


def test_stop_string_across_many_small_additions_and_one_big_one():
    text = "x" * 5000 + "the END is near"
    big = TextStream(BYTES, stop=["END"])
    assert big.add(list(text.encode()), final=False) == "x" * 5000 + "the "
    small = TextStream(BYTES, stop=["END"])
    assert "".join(_stream_one_by_one(small, list(text.encode()))) == "x" * 5000 + "the "


def test_partial_stop_released_when_final():
    stream = TextStream(BYTES, stop=["abc"])
    assert stream.add(list(b"xxab"), final=False) == "xx"
    assert stream.add([BYTES.eos_token_id], final=True) == "ab" and not stream.stopped


# --- request limits --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stop",
    [[f"s{i}" for i in range(17)], "x" * 257, ["ok", "y" * 257]],
    ids=["17-strings", "257-chars", "one-too-long"],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_limits_are_400_naming_stop(open_server, path, stop):
    body = {"model": MODEL, "max_tokens": 2, "stop": stop}
    body |= (
        {"prompt": "hi"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = open_server.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stop" and err["type"] == "invalid_request_error"


def test_stop_limits_allow_the_maximum(open_server):
    stop = [f"{i:02d}" + "z" * 254 for i in range(16)]
    r = open_server.post(
        "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": stop}
    )
    assert r.status_code == 200, r.text


class PieceTokenizer:
    """Byte-level pieces, some ending in a character's first byte (as byte-level BPE merges
    "a" with the lead byte after it)."""

    PIECES = {0: b"h\xc3\xa9", 1: b"a\xc3", 2: b"\xa9", 3: b"z"}
    vocab_size, eos_token_id = 4, None

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.PIECES[token_id]


def test_a_stop_string_ends_the_choice_on_the_token_that_completes_it():
    """The token "a\\xc3" completes "éa" and starts a character: the stop string is found on it,
    not one token later when that character is complete."""
    stream = TextStream(PieceTokenizer(), ["éa"])
    assert stream.add([0], final=False) == "h"  # "é" is held: the stop string starts with it
    assert stream.add([1], final=False) == ""
    assert stream.stopped and stream.text == "h"


def test_text_before_a_character_still_arriving_goes_out_with_its_token():
    stream = TextStream(PieceTokenizer())
    offsets, sent = [], []
    for t in (0, 1, 2, 3):
        offsets.append(stream.offset_of(t))
        sent.append(stream.add([t], final=t == 3))
    assert "".join(sent) == "héaéz" == PieceTokenizer().decode([0, 1, 2, 3])
    assert sent == ["hé", "a", "é", "z"]  # the "a" before "\xc3" did not wait for it
    assert offsets == [0, 2, 3, 4]
