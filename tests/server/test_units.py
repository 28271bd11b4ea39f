"""Unit tests of the server's pure parts: incremental text with stop strings, chat templates,
API-key files and tenant salts."""

from __future__ import annotations

import json

import pytest

from kvpage.model.tokenizer import ByteTokenizer
from kvpage.server.chat import load_chat_template, simple_template
from kvpage.server.protocol import ApiError
from kvpage.server.tenants import Tenants, load_api_keys
from kvpage.server.text_stream import TextStream

TOK = ByteTokenizer()


def _feed(stream: TextStream, data: bytes, final_at_end: bool = True) -> list[str]:
    pieces = [stream.add([b], final=False) for b in data[:-1]]
    return [*pieces, stream.add([data[-1]], final=final_at_end)]


def test_text_stream_holds_back_incomplete_utf8():
    stream = TextStream(TOK)
    pieces = _feed(stream, "aé€b".encode())
    assert "".join(pieces) == "aé€b"
    assert all("\ufffd" not in p for p in pieces)


def test_text_stream_stop_string_across_tokens():
    stream = TextStream(TOK, stop=["STOP"])
    pieces = [stream.add([b], final=False) for b in b"abcSTOPdef"]
    assert "".join(pieces) == "abc" and stream.stopped and stream.text == "abc"


def test_text_stream_holds_back_a_possible_stop_prefix():
    stream = TextStream(TOK, stop=["xyz"])
    assert stream.add(list(b"abxy"), final=False) == "ab"  # "xy" may become "xyz"
    assert stream.add([ord("q")], final=False) == "xyq"
    assert stream.add([ord("x")], final=False) == ""
    assert stream.add([TOK.eos_token_id], final=True) == "x" and not stream.stopped


def test_simple_chat_template():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert simple_template(messages) == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"
    assert load_chat_template("builtin:tiny-llama") is simple_template


def test_hf_chat_template(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    template += "{% if add_generation_prompt %}[assistant]{% endif %}"
    config = {"chat_template": template, "bos_token": {"content": "<s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    render = load_chat_template(str(tmp_path))
    assert render([{"role": "user", "content": "hi"}]) == "<s>[user]hi[assistant]"


def test_api_key_files(tmp_path):
    lines = tmp_path / "keys.txt"
    lines.write_text("# key tenant\nk1 alice\n\nk2 bob\n")
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps({"k1": "alice", "k2": "bob"}))
    assert load_api_keys(lines) == load_api_keys(as_json) == {"k1": "alice", "k2": "bob"}
    lines.write_text("k1 alice extra\n")
    with pytest.raises(ValueError):
        load_api_keys(lines)


def test_tenant_salts():
    tenants = Tenants({"k1": "alice", "k2": "bob"})
    assert tenants.authenticate("Bearer k2") == "bob"
    for header in (None, "Bearer nope", "Basic k1"):
        with pytest.raises(ApiError) as err:
            tenants.authenticate(header)
        assert err.value.status == 401
    alice = tenants.cache_salt("alice", None)
    assert alice != tenants.cache_salt("bob", None) and alice != "alice"
    assert alice != Tenants({"k1": "alice"}).salt_for("alice")  # secret per server start
    assert Tenants().cache_salt(None, "mine") == "mine"  # open server: the client's salt
