"""Input real clients and attackers send, each answered 400 naming the field and saying what
failed, with the engine still serving afterwards."""

from __future__ import annotations

import httpx
import pytest

from kvpage import EngineConfig, LLMEngine, SamplingParams
from kvpage.errors import InvalidRequest

CHAT = [{"role": "user", "content": "hi"}]
VOCAB = 258  # builtin:tiny-llama's


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
        ("/v1/completions", {"stop_token_ids": [2**70]}, "stop_token_ids", "outside"),
        ("/v1/completions", {"stop_token_ids": [5] * 100_000}, "stop_token_ids", "at most 1024"),
        ("/v1/completions", {"top_k": VOCAB + 1}, "top_k", "more than the vocabulary"),
        ("/v1/completions", {"top_k": 2**70}, "top_k", "top_k"),
        ("/v1/chat/completions", {"max_completion_tokens": 5000}, "max_completion_tokens", "5000"),
    ],
)
def test_bad_field_is_400_naming_it(open_server, path, body, param, says):
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    r = open_server.post(path, {**base, "max_tokens": 2, **body})
    if param == "max_completion_tokens":
        r = open_server.post(path, {**base, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert says in error["message"], error
    assert "max_tokens" not in error["message"] or param != "max_completion_tokens"
    assert open_server.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "too many digits"),
        (b"[" * 10_000 + b"]" * 10_000, "nests too deeply"),
        (b'{"prompt": "\xff\xfe"}', "not valid UTF-8 (byte 0xff at offset 12)"),
    ],
)
def test_unparsable_body_says_what_failed(open_server, raw, says):
    r = httpx.post(
        f"{open_server.url}/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400
    assert says in r.json()["error"]["message"]
    assert open_server.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_engine_refuses_stop_ids_and_top_k_outside_the_vocabulary():
    engine = LLMEngine(EngineConfig(num_blocks=16))
    for params, field in (
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
        (SamplingParams(stop_token_ids=(2**70,)), "stop_token_ids"),
        (SamplingParams(top_k=VOCAB + 1), "top_k"),
        (SamplingParams(logprobs=VOCAB + 1), "logprobs"),
    ):
        with pytest.raises(InvalidRequest, match=field):
            engine.add_request("r", [1, 2, 3], params)
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", [1, 2, 3], SamplingParams(top_k=VOCAB, max_tokens=1))
    assert engine.step()[0].finished
