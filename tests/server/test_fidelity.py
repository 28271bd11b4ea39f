"""OpenAI/vLLM fidelity that clients trip on: OpenAI's error shape for unknown routes and
methods, GET /v1/models/{id}, the chosen token's logprob outside the top k, raw token bytes,
text_offset across stream chunks, `usage: null` on intermediate chunks, and fields the server
does not implement refused by name rather than ignored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch

from kvpage import EngineConfig, LLMEngine, SamplingParams
from kvpage.engine.outputs import CompletionOutput
from kvpage.model import load_model
from kvpage.model.tokenizer import ByteTokenizer
from kvpage.reference.generator import generate
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer
from kvpage.server.chat import simple_template
from kvpage.server.generation import Choice
from kvpage.server.text_stream import TextStream
from kvpage.verify.stack.text_oracle import text_offsets
from tests.waiting import READY_S, settled

from .conftest import MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "Fidelity: the paged KV cache "
HOT = {"temperature": 3.0, "seed": 9, "ignore_eos": True}  # samples well outside the top 1


@dataclass
class Served:
    url: str
    engine: LLMEngine

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=60)

    def stream(self, path: str, body: dict) -> list[dict]:
        """The data of every SSE event but [DONE], as parsed JSON."""
        r = self.post(path, {**body, "stream": True})
        assert r.status_code == 200, r.text
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=60)

    def assert_idle(self, timeout: float = READY_S) -> None:
        def idle(s: dict) -> bool:
            busy = s["running"] or s["waiting"] or s["private_blocks"] or s["shared_blocks"]
            return not (busy or self.engine.cache.live_tables)

        s = settled(self.engine.stats, idle, timeout)
        assert s["private_blocks"] == s["shared_blocks"] == 0, s
        assert s["running"] == s["waiting"] == s["swapped"] == 0, s
        assert not self.engine.cache.live_tables


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=64, max_num_seqs=8))
    options = ServerOptions(model_name=MODEL, shadow_rate=0.0)
    with BackgroundServer(create_app(engine, options)) as bg:
        yield Served(bg.url, engine)


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL)


def _openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    return error


def _raw_logprobs(tiny, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """The raw log_softmax of each served token, from the contiguous reference run alone with the
    same seed (which must draw the same tokens)."""
    model, _ = tiny
    params = SamplingParams(max_tokens=len(token_ids), **HOT)
    ref = generate(model, prompt_ids, params)
    assert ref.token_ids == token_ids
    steps = zip(ref.step_logits, token_ids, strict=True)
    return [float(torch.log_softmax(logits, -1)[t]) for logits, t in steps]


# --- item 6: routes ---------------------------------------------------------------------------
def test_unknown_route_and_wrong_method_in_openai_shape(served):
    r = httpx.get(f"{served.url}/v1/no-such-thing", timeout=30)
    assert "/v1/no-such-thing" in _openai_error(r, 404)["message"]
    r = httpx.post(f"{served.url}/v1/nope", json={}, timeout=30)
    _openai_error(r, 404)
    r = httpx.get(f"{served.url}/v1/completions", timeout=30)
    assert _openai_error(r, 405)["type"] == "invalid_request_error"
    assert "POST" in r.headers.get("allow", "")
    r = httpx.delete(f"{served.url}/v1/models", timeout=30)
    _openai_error(r, 405)


def test_get_one_model(served):
    card = served.client().models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    listed = served.client().models.list().data
    assert [m.model_dump() for m in listed] == [card.model_dump()]
    for unknown in ("gpt-17", "org/some-model"):
        r = httpx.get(f"{served.url}/v1/models/{unknown}", timeout=30)
        assert unknown in _openai_error(r, 404, "model")["message"]
    with pytest.raises(openai.NotFoundError):
        served.client().models.retrieve("gpt-17")


# --- item 7: the chosen token's logprob, also outside the top k -------------------------------
def test_completion_token_logprobs_outside_the_top_k(served, tiny):
    """A sampled token outside the top 1 had `token_logprobs: null`."""
    body = {"prompt": PROMPT, "max_tokens": 16, "logprobs": 1, "return_token_ids": True, **HOT}
    choice = served.post(COMPLETIONS, body).json()["choices"][0]
    lp, ids = choice["logprobs"], choice["token_ids"]
    _, tok = tiny
    want = _raw_logprobs(tiny, tok.encode(PROMPT), ids)
    assert lp["token_logprobs"] == pytest.approx(want, abs=1e-5)
    tops = lp["top_logprobs"]
    # the top 1 and, when the sampled token is not it, the sampled token too (OpenAI and vLLM)
    outside = [i for i, top in enumerate(tops) if len(top) == 2]
    assert outside  # the case really samples outside the top 1
    for i, top in enumerate(tops):
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]
        assert len(top) == 1 or lp["token_logprobs"][i] < max(top.values())
    streamed = served.stream(COMPLETIONS, body)
    chosen = [v for c in streamed for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert chosen == pytest.approx(want, abs=1e-5)
    served.assert_idle()


def test_chat_logprob_with_top_logprobs_zero(served, tiny):
    """top_logprobs 0: no alternatives, but each token's own logprob (it was null unless the
    token happened to be the engine's top 1)."""
    messages = [{"role": "user", "content": "Say something hot"}]
    body = {"messages": messages, "max_tokens": 12, "logprobs": True, "top_logprobs": 0, **HOT}
    choice = served.post(CHAT, {**body, "return_token_ids": True}).json()["choices"][0]
    content = choice["logprobs"]["content"]
    _, tok = tiny
    want = _raw_logprobs(tiny, tok.encode(simple_template(messages)), choice["token_ids"])
    assert [c["logprob"] for c in content] == pytest.approx(want, abs=1e-5)
    assert all(c["top_logprobs"] == [] for c in content)
    served.assert_idle()


# --- item 8: raw bytes and text_offset --------------------------------------------------------
def test_chat_logprob_bytes_are_the_tokens_raw_bytes(served):
    """A byte that is part of a character reads `token_id:N` as text; its bytes were the bytes
    of that spelling. They are the token's own byte (None for BOS/EOS, which have no text)."""
    messages = [{"role": "user", "content": "Bytes, please: \u00e9\u20ac\u2603"}]
    body = {"messages": messages, "max_tokens": 24, "logprobs": True, "top_logprobs": 5, **HOT}
    choice = served.post(CHAT, {**body, "return_token_ids": True}).json()["choices"][0]
    content, ids = choice["logprobs"]["content"], choice["token_ids"]
    assert any(c["token"].startswith("token_id:") for c in content)  # partial UTF-8 seen
    for entry, token_id in zip(content, ids, strict=True):
        assert entry["bytes"] == ([token_id] if token_id < 256 else None)
        for alt in entry["top_logprobs"]:
            if alt["token"].startswith("token_id:"):
                alt_id = int(alt["token"].split(":")[1])
                assert alt["bytes"] == ([alt_id] if alt_id < 256 else None)
            else:
                assert bytes(alt["bytes"]).decode() == alt["token"]
    whole = b"".join(bytes(c["bytes"] or b"") for c in content)
    assert whole.decode("utf-8", errors="replace") == choice["message"]["content"]
    served.assert_idle()


def test_text_offset_counts_characters_of_the_returned_text_across_chunks(served):
    body = {"prompt": PROMPT, "max_tokens": 24, "logprobs": 0, **HOT}
    chunks = served.stream(COMPLETIONS, body)
    sent, offsets = "", []
    for chunk in chunks:
        choice = chunk["choices"][0]
        for offset in choice["logprobs"]["text_offset"]:
            # one token per chunk here: it starts at or after the text sent so far (past it when
            # bytes held back as not yet a character turn out to be U+FFFD, sent later)
            assert offset >= len(sent)
            offsets.append(offset)
        sent += choice["text"]
    assert offsets[0] == 0 and len(offsets) == 24
    full = served.post(COMPLETIONS, body).json()["choices"][0]
    assert full["text"] == sent
    assert full["logprobs"]["text_offset"] == offsets
    assert all(0 <= o <= len(sent) for o in offsets)
    assert offsets == sorted(offsets)
    pieces = [_token_bytes(t) for t in full["logprobs"]["tokens"]]
    assert offsets == text_offsets(pieces, len(sent))  # the independent text oracle's


def _token_bytes(token: str) -> bytes:
    """A byte-level token's bytes from its spelling (`token_id:N` when not text alone)."""
    if token.startswith("token_id:"):
        n = int(token.split(":")[1])
        return bytes([n]) if n < 256 else b""
    return token.encode()
    served.assert_idle()


def test_text_offset_counts_text_held_back_for_a_stop_string():
    """Text that may start a stop string is held back, then sent with the next token's text;
    that token still starts after it."""
    choice = Choice(0, TextStream(ByteTokenizer(), ["Sx"]))
    offsets = []
    for i, token in enumerate(b"aSbSx"):
        out = CompletionOutput(0, [token], "", [{token: -1.0}], None, [-1.0])
        delta = choice.advance(out, [token], final=i == 4)
        offsets += delta.logprobs.offsets
    assert choice.text.text == "aSb" and choice.finish_reason == "stop"
    assert offsets == [0, 1, 2, 3, 3]  # "x" ends the stop string: it starts where text ends
    assert choice.logprobs.offsets == offsets and choice.logprobs.chosen == [-1.0] * 5


# --- item 9: usage null on every chunk but the last -------------------------------------------
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_usage_is_null_on_intermediate_chunks(served, path):
    body = {"max_tokens": 6, "n": 2, **HOT}
    body |= {"prompt": PROMPT} if path == COMPLETIONS else {"messages": [{"role": "user"}]}
    chunks = served.stream(path, {**body, "stream_options": {"include_usage": True}})
    *intermediate, last = chunks
    assert intermediate and all("usage" in c and c["usage"] is None for c in intermediate)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    plain = served.stream(path, body)
    assert all("usage" not in c for c in plain)
    served.assert_idle()


# --- item 10: unimplemented fields are refused by name ----------------------------------------
UNSUPPORTED = [  # (path, field, a value that would change the output)
    (COMPLETIONS, "logit_bias", {"65": 100}),
    (COMPLETIONS, "min_p", 0.1),
    (COMPLETIONS, "repetition_penalty", 1.2),
    (COMPLETIONS, "min_tokens", 4),
    (COMPLETIONS, "length_penalty", 0.5),
    (COMPLETIONS, "use_beam_search", True),
    (COMPLETIONS, "guided_json", {"type": "object"}),
    (COMPLETIONS, "guided_choice", ["a", "b"]),
    (COMPLETIONS, "allowed_token_ids", [65, 66]),
    (COMPLETIONS, "bad_words", ["x"]),
    (COMPLETIONS, "include_stop_str_in_output", True),
    (CHAT, "logit_bias", {"65": -100}),
    (CHAT, "min_p", 0.05),
    (CHAT, "repetition_penalty", 0.9),
    (CHAT, "min_tokens", 1),
    (CHAT, "echo", True),
]


def _body(path: str, **fields) -> dict:
    if path == COMPLETIONS:
        return {"prompt": "x", "max_tokens": 2, **fields}
    return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **fields}


@pytest.mark.parametrize(("path", "field", "value"), UNSUPPORTED)
def test_unimplemented_field_is_400_naming_it(served, path, field, value):
    error = _openai_error(served.post(path, _body(path, **{field: value})), 400, field)
    assert "not supported" in error["message"]


NEUTRAL = {  # the defaults, sent explicitly: nothing to ignore
    "logit_bias": {},
    "response_format": {"type": "text"},
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "tools": [],
    "tool_choice": "none",
    "user": "someone",
    "skip_special_tokens": True,
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_default_values_of_those_fields_are_accepted(served, path):
    r = served.post(path, _body(path, **NEUTRAL))
    assert r.status_code == 200, r.text
    r = served.post(path, _body(path, **dict.fromkeys(NEUTRAL)))  # all null
    assert r.status_code == 200, r.text
    served.assert_idle()


def test_top_logprobs_needs_logprobs_and_stream_options_need_stream(served):
    r = served.post(CHAT, _body(CHAT, top_logprobs=2))
    _openai_error(r, 400, "top_logprobs")
    r = served.post(CHAT, _body(CHAT, top_logprobs=2, logprobs=False))
    _openai_error(r, 400, "top_logprobs")
    r = served.post(COMPLETIONS, _body(COMPLETIONS, stream_options={"include_usage": True}))
    _openai_error(r, 400, "stream_options")
    served.assert_idle()


def test_hf_token_bytes(tmp_path):
    """Raw bytes of Hugging Face tokens: byte-level BPE through GPT-2's byte alphabet,
    SentencePiece's `<0xNN>` and `▁`; special tokens have none."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from kvpage.model.tokenizer import HFTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"], initial_alphabet=alphabet)
    text = "héllo wörld, €5 ☃"
    bpe.train_from_iterator([text] * 3, trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "tokenizer.json", None, None)
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_bytes(bpe.token_to_id("<s>")) is None

    vocab = {"<unk>": 0, "\u2581hi": 1, "<0x41>": 2}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.add_special_tokens([AddedToken("<unk>", special=True)])
    sp.save(str(tmp_path / "sp.json"))
    tok = HFTokenizer(tmp_path / "sp.json", None, None)
    assert [tok.token_bytes(i) for i in range(3)] == [None, b" hi", b"A"]
