"""Bad input -> HTTP 400 with an OpenAI-style error body naming the field; the server keeps
serving afterwards."""

from __future__ import annotations

import httpx
import pytest

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer

from .conftest import MODEL

CHAT = [{"role": "user", "content": "hi"}]
BAD = [  # (path, body, field named)
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),  # 1 <= n <= 16
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 99}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),  # a batch with an empty prompt
    ("/v1/completions", {"prompt": [[1, 2], [1, 99999]]}, "prompt"),  # its second outside
    ("/v1/completions", {"prompt": "x" * 1100}, "prompt"),  # more KV blocks than the pool
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}, "seed"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": -1}, "top_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_input_is_400_naming_the_field(open_server, path, body, param):
    r = open_server.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_json_and_unknown_model(open_server):
    r = httpx.post(
        f"{open_server.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = open_server.post("/v1/completions", {"prompt": "x", "model": "gpt-17"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_server_survives_bad_requests(open_server):
    key = "kvpage_http_requests_total{path=/v1/completions,status=400}"
    rejected = open_server.metrics().get(key, 0)
    for path, body, _ in BAD:
        open_server.post(path, body)
    m = open_server.metrics()
    grew = m[key] - rejected
    assert grew == sum(path == "/v1/completions" for path, _, _ in BAD)
    client = open_server.client()
    r = client.completions.create(model=MODEL, prompt="still up?", max_tokens=3, temperature=0)
    assert 1 <= r.usage.completion_tokens <= 3
    stats = open_server.wait_idle()
    assert stats["private_blocks"] == 0 and stats["waiting"] == 0


def test_engine_failure_fails_requests_not_the_server():
    """If a step raises (a bug), requests in flight get a 500 / an error event; serving goes on."""
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=32))
    original, failures = engine.step, [1, 1]

    def flaky_step():
        if failures:
            failures.pop()
            raise RuntimeError("injected step failure")
        return original()

    engine.step = flaky_step
    app = create_app(engine, ServerOptions(model_name=MODEL, shadow_rate=0.0))
    with BackgroundServer(app) as server:
        body = {"prompt": "boom", "max_tokens": 4}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30)
        assert '"error"' in r.text and r.text.endswith("data: [DONE]\n\n")
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert engine.stats()["private_blocks"] == 0
