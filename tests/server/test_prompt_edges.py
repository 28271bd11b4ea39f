"""Prompt edges (issue 40): token ids sent as integer-valued JSON numbers (`450.0`) are token
ids, other numbers are refused by field; a prompt of exactly `max_model_len` tokens is scored
with `echo: true, max_tokens: 0` (every position, against transformers' logits on the same
weights) and refused with any token to draw."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
import torch
import transformers

from kvpage import EngineConfig, LLMEngine, SamplingParams
from kvpage.errors import InvalidRequest
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer

from ..engine.test_differential import assert_idle_baseline
from ..real_servers.models import CLIENT_TINY, build
from ..waiting import settled

TOL = 1e-4  # fp32 on both sides
CONTEXT = 48  # max_model_len: three 16-token blocks
SPEC = replace(CLIENT_TINY, name="edges-tiny")
NAME = "edges-model"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = build(tmp_path_factory.mktemp("edges-model"), SPEC)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()
    config = EngineConfig(model=str(directory), num_blocks=16, block_size=16, max_model_len=CONTEXT)
    engine = LLMEngine(config)
    with BackgroundServer(create_app(engine, ServerOptions(model_name=NAME))) as bg:
        yield bg.url, hf, engine


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": NAME, **body}, timeout=60)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(259, SPEC.vocab_size, (n - 1,), generator=g).tolist()]


def _reference(hf, ids: list[int]) -> list[float]:
    """Each prompt token's logprob after the ones before it (transformers, whole prompt)."""
    with torch.no_grad():
        rows = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [rows[p - 1, ids[p]].item() for p in range(1, len(ids))]


def _wait_idle(engine: LLMEngine) -> None:
    """The engine thread frees a finished request's blocks after the response is sent."""
    settled(engine.stats, lambda s: not (s["running"] or s["waiting"] or s["private_blocks"]))


# --- C: a prompt that fills the context ------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_of_max_model_len_tokens_is_scored_with_max_tokens_zero(served, stream):
    url, hf, engine = served
    ids = _ids(CONTEXT, 7)
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
    r = _post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [line for line in r.text.splitlines() if line.startswith("data: {")]
        choices = [json.loads(c[6:])["choices"][0] for c in chunks]
        got = [v for c in choices if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        assert choices[-1]["finish_reason"] == "length"
    else:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
        got = choice["logprobs"]["token_logprobs"]
    assert len(got) == CONTEXT and got[0] is None
    ref = _reference(hf, ids)
    assert max(abs(a - b) for a, b in zip(got[1:], ref, strict=True)) <= TOL
    _wait_idle(engine)
    assert_idle_baseline(engine)  # no block kept by the scored request


def test_scoring_the_full_context_agrees_with_its_shorter_prefix(served):
    url, _, _ = served
    ids = _ids(CONTEXT, 8)
    full = _post(
        url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    )
    short = _post(
        url, "/v1/completions", {"prompt": ids[:-5], "max_tokens": 0, "echo": True, "logprobs": 0}
    )
    a = full.json()["choices"][0]["logprobs"]["token_logprobs"]
    b = short.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(x - y) for x, y in zip(a[1 : CONTEXT - 5], b[1:], strict=True)) <= TOL


def test_a_full_prompt_with_a_token_to_draw_is_refused(served):
    url, _, engine = served
    ids = _ids(CONTEXT, 9)
    for extra in ({"max_tokens": 1}, {"max_tokens": 1, "echo": True, "logprobs": 1}, {}):
        r = _post(url, "/v1/completions", {"prompt": ids, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and "max_tokens 0" in err["message"], err
    r = _post(url, "/v1/completions", {"prompt": [*ids, 5], "max_tokens": 0, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    ok = _post(url, "/v1/completions", {"prompt": ids[:-1], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_the_engine_refuses_a_token_past_a_full_context(served):
    """The engine's own admission (the server's thread steps it: nothing is queued here)."""
    _, _, engine = served
    with pytest.raises(InvalidRequest, match="max_tokens 0"):
        engine.add_request("probe", _ids(CONTEXT, 10), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="prompt has 49 tokens"):
        engine.add_request("probe", _ids(CONTEXT + 1, 10), SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequest, match="max_tokens must be >= 0"):
        SamplingParams(max_tokens=-1)


# --- B: integer-valued numbers as token ids --------------------------------------------------
def test_integer_valued_floats_are_token_ids(served):
    url, _, _ = served
    ids = _ids(10, 11)
    as_ints = _post(url, "/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0})
    floats = [float(t) for t in ids]
    for prompt in (floats, [floats]):
        r = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == as_ints.json()["choices"][0]["text"]
    r = _post(url, "/detokenize", {"tokens": [float(t) for t in ids[1:]]})
    assert r.status_code == 200, r.text
    assert r.json() == _post(url, "/detokenize", {"tokens": ids[1:]}).json()
    stop = _post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "stop_token_ids": [3.0]})
    assert stop.status_code == 200, stop.text


@pytest.mark.parametrize("bad", [450.5, True, "450", 1e-3])
@pytest.mark.parametrize("where", ["prompt", "batch", "detokenize", "stop_token_ids"])
def test_other_numbers_are_not_token_ids(served, bad, where):
    url, _, _ = served
    path, body, param = {
        "prompt": ("/v1/completions", {"prompt": [1, bad], "max_tokens": 1}, "prompt"),
        "batch": ("/v1/completions", {"prompt": [[1, 2], [1, bad]], "max_tokens": 1}, "prompt"),
        "detokenize": ("/detokenize", {"tokens": [1, bad]}, "tokens"),
        "stop_token_ids": (
            "/v1/completions",
            {"prompt": [1, 2], "stop_token_ids": [bad], "max_tokens": 1},
            "stop_token_ids",
        ),
    }[where]
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_nan_and_a_huge_integral_float_are_refused(served):
    url, _, _ = served
    nan = b'{"prompt": [1, NaN], "max_tokens": 1}'
    headers = {"Content-Type": "application/json"}
    r = httpx.post(f"{url}/v1/completions", content=nan, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = _post(url, "/v1/completions", {"prompt": [1, 1e20], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
