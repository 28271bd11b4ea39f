"""Bad input is a 400 naming the field, never a 500, and leaves nothing behind in the engine (issue
11): out-of-range seeds, lone surrogates, values so small that softmax underflows, booleans and
floats as token ids, strings for numbers, NaN/Infinity literals, truncated JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer
from tests.waiting import READY_S, settled

from .conftest import MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class Served:
    url: str
    engine: LLMEngine

    def post(self, path: str, body: dict | str | bytes) -> httpx.Response:
        """`body` as a dict is sent as ASCII JSON, so a lone surrogate travels as `\\ud800`."""
        raw = json.dumps(body) if isinstance(body, dict) else body
        headers = {"content-type": "application/json"}
        return httpx.post(f"{self.url}{path}", content=raw, headers=headers, timeout=60)

    def assert_idle(self, timeout: float = READY_S) -> None:
        """Nothing held: no table, block, running or waiting request (polled: aborts are
        carried out by the engine thread between steps)."""

        def idle(s: dict) -> bool:
            busy = s["running"] or s["waiting"] or s["swapped"]
            held = s["private_blocks"] or s["shared_blocks"] or self.engine.cache.live_tables
            return not (busy or held)

        s = settled(self.engine.stats, idle, timeout)
        assert s["private_blocks"] == s["shared_blocks"] == 0, s
        assert s["running"] == s["waiting"] == s["swapped"] == 0, s
        assert not self.engine.cache.live_tables
        assert not self.engine.seqs


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=64, max_num_seqs=8))
    options = ServerOptions(model_name=MODEL, shadow_rate=0.0)
    with BackgroundServer(create_app(engine, options)) as bg:
        yield Served(bg.url, engine)


def _assert_400(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "Traceback" not in error["message"] and "internal" not in error["message"]
    return error


def _chat(content, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}


# --- item 1: seeds outside the 64-bit range ---------------------------------------------------
SEEDS = [  # (path, body)
    (COMPLETIONS, {"prompt": "x", "temperature": 1.0, "seed": 2**64}),
    (COMPLETIONS, {"prompt": "x", "temperature": 1.0, "seed": 2**65}),
    (COMPLETIONS, {"prompt": "x", "temperature": 1.0, "seed": -(2**63) - 1}),
    (COMPLETIONS, {"prompt": "x", "temperature": 1.0, "seed": 2**64 - 1, "n": 2}),  # seed + 1
    (CHAT, _chat("hi", temperature=1.0, seed=2**64)),
]


@pytest.mark.parametrize(("path", "body"), SEEDS)
def test_seed_out_of_range_is_400_naming_seed_and_leaves_no_table(served, path, body):
    """It was a 500 (torch's manual_seed overflowed) and an orphan block table per request, since
    the engine made the table before the generator; n = 2 failed a step after the fork."""
    error = _assert_400(served.post(path, {**body, "max_tokens": 2}), "seed")
    assert "seed" in error["message"]
    served.assert_idle()


def test_extreme_seeds_in_range_are_served(served):
    for seed in (2**64 - 1, -(2**63), 2**64 - 2):
        n = 2 if seed == 2**64 - 2 else 1
        body = {"prompt": "x", "temperature": 1.0, "seed": seed, "n": n, "max_tokens": 2}
        r = served.post(COMPLETIONS, body)
        assert r.status_code == 200, r.text
    served.assert_idle()


# --- item 2: lone surrogates ------------------------------------------------------------------
SURROGATES = [  # (path, body, field named)
    (COMPLETIONS, {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    (COMPLETIONS, {"prompt": ["\udfff"], "max_tokens": 2}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "cache_salt": "\udc00", "max_tokens": 2}, "cache_salt"),
    (COMPLETIONS, {"prompt": "x", "stop": ["ok", "\ud83d"], "max_tokens": 2}, "stop"),
    (CHAT, _chat("\ud800"), "messages.0.content"),
    (CHAT, _chat([{"type": "text", "text": "\udbff"}]), "messages.0.content.0.text"),
    (CHAT, _chat("hi", cache_salt="\ud800"), "cache_salt"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATES)
def test_lone_surrogate_is_400_naming_the_field(served, path, body, param):
    """They parse from JSON (`"\\ud800"`) but no UTF-8 encoder takes them: it was a 500."""
    error = _assert_400(served.post(path, body), param)
    assert "surrogate" in error["message"]
    served.assert_idle()


def test_surrogate_as_raw_utf8_bytes_and_in_the_model_name(served):
    """CESU-style bytes ED A0 80 decode (Python's JSON reader passes them) to a lone surrogate;
    a model name that holds one is a 404 whose message does not fail to encode."""
    raw = b'{"prompt": "a\xed\xa0\x80", "max_tokens": 2}'
    _assert_400(served.post(COMPLETIONS, raw), "prompt")
    r = served.post(COMPLETIONS, {"prompt": "x", "model": "m\ud800", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    served.assert_idle()


# --- item 3: softmax underflow ----------------------------------------------------------------
def _completion_ids(served: Served, **fields) -> list[int]:
    body = {"prompt": "Underflow ", "max_tokens": 8, "return_token_ids": True, **fields}
    r = served.post(COMPLETIONS, {**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1e-40, "seed": 1},  # logits / T overflowed to inf: NaN probabilities
        {"temperature": 1e-6, "seed": 1},  # below 1e-5: greedy, as in vLLM
        {"temperature": 1.0, "top_p": 1e-50, "seed": 3},  # 0 in float32: every token dropped
        {"temperature": 1.0, "top_p": 1e-300, "top_k": 3, "seed": 4},
    ],
)
def test_tiny_temperature_or_top_p_is_greedy_not_token_zero(served, fields):
    """NaN probabilities used to draw token 0 at every step."""
    greedy = _completion_ids(served, temperature=0.0)
    got = _completion_ids(served, **fields)
    assert got == greedy and set(got) != {0}
    served.assert_idle()


# --- item 4: strict types ---------------------------------------------------------------------
STRICT = [  # (path, body, field named)
    (COMPLETIONS, {"prompt": [True, 2]}, "prompt"),
    (COMPLETIONS, {"prompt": [1.5, 2]}, "prompt"),
    (COMPLETIONS, {"prompt": [[3, False]]}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": "0.5"}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "temperature": True}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "seed": True}, "seed"),
    (COMPLETIONS, {"prompt": "x", "seed": 1.5}, "seed"),
    (COMPLETIONS, {"prompt": "x", "n": True}, "n"),
    (COMPLETIONS, {"prompt": "x", "top_k": 5.0}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "x", "logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (CHAT, _chat(7), "messages.0.content"),
    (CHAT, _chat([{"type": "text", "text": 1}]), "messages.0.content"),
    (CHAT, _chat("hi", logprobs=1), "logprobs"),
    (CHAT, _chat("hi", logprobs=True, top_logprobs=2.0), "top_logprobs"),
    (CHAT, _chat("hi", max_completion_tokens="4"), "max_completion_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), STRICT)
def test_no_coercion_and_the_field_is_named(served, path, body, param):
    """`true` is not token 1, `1.5` no token, `2.0` not a count, `"3"` not 3; the param is the
    field (`prompt`), never a pydantic union tag (`prompt.str`, `prompt.list[int]`). A token id
    may be `1.0` (tests/server/test_prompt_edges.py)."""
    error = _assert_400(served.post(path, {"max_tokens": 2, **body}), param)
    assert "list[" not in error["message"] and ".str" not in error["message"], error
    served.assert_idle()


NON_FINITE = [  # raw bodies: Python's JSON reader accepts these literals
    ('{"prompt": "x", "temperature": NaN}', "temperature"),
    ('{"prompt": "x", "top_p": Infinity}', "top_p"),
    ('{"prompt": "x", "presence_penalty": -Infinity}', "presence_penalty"),
    ('{"prompt": "x", "seed": NaN}', "seed"),
    ('{"prompt": [NaN]}', "prompt"),
    ('{"prompt": "x", "stream_options": {"include_usage": NaN}, "stream": true}', None),
]


@pytest.mark.parametrize(("raw", "param"), NON_FINITE)
def test_nan_and_infinity_literals_are_rejected(served, raw, param):
    r = served.post(COMPLETIONS, raw)
    error = _assert_400(r, param or "stream_options.include_usage")
    if param in ("temperature", "top_p", "presence_penalty"):
        assert "finite" in error["message"], error
    served.assert_idle()


# --- item 5: truncated JSON -------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw", ['{"prompt": "x", "max_tokens": 2', '{"prompt": "x', "{", '{"prompt": "x",}']
)
def test_truncated_json_says_the_body_is_not_valid_json(served, raw):
    error = _assert_400(served.post(COMPLETIONS, raw), None)
    assert "not valid JSON" in error["message"], error
    assert " at at " not in error["message"], error
    served.assert_idle()


def test_empty_or_non_object_body(served):
    assert "empty" in _assert_400(served.post(COMPLETIONS, b""), None)["message"]
    assert "JSON object" in _assert_400(served.post(CHAT, "[1, 2]"), None)["message"]


def test_server_still_serves_after_every_bad_input(served):
    for path, body in SEEDS:
        served.post(path, body)
    for path, body, _ in SURROGATES + STRICT:
        served.post(path, body)
    r = served.post(COMPLETIONS, {"prompt": "still up?", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    served.assert_idle()
