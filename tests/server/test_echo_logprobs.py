"""Completions `echo`, prompt logprobs (OpenAI's echo and vLLM's `prompt_logprobs`) over HTTP,
against transformers' full-prompt logits on the same random weights, with prefix caching on and
the prompt's blocks already cached; a stream agrees with the whole response."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
import torch
import transformers

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer

from ..real_servers.models import CLIENT_TINY, build

TOL = 1e-4  # fp32 on both sides
SPEC = replace(CLIENT_TINY, name="echo-tiny")
NAME = "echo-model"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = build(tmp_path_factory.mktemp("echo-model"), SPEC)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()
    engine = LLMEngine(EngineConfig(model=str(directory), num_blocks=64, block_size=16))
    options = ServerOptions(model_name=NAME, shadow_rate=0.0)
    with BackgroundServer(create_app(engine, options)) as bg:
        yield bg.url, hf, engine


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": NAME, **body}, timeout=60)


def _ref(hf, ids: list[int]) -> torch.Tensor:
    """(L, V) log-softmax: row p scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(259, SPEC.vocab_size, (n - 1,), generator=g).tolist()]


def _echo_errors(hf, ids, lp) -> float:
    ref = _ref(hf, ids)
    got = lp["token_logprobs"][: len(ids)]
    assert got[0] is None and lp["top_logprobs"][0] is None
    return max(abs(got[p + 1] - ref[p, ids[p + 1]].item()) for p in range(len(ids) - 1))


def test_lm_eval_loglikelihood_request_matches_transformers_cold_and_cached(served):
    """lm-evaluation-harness's local-completions loglikelihood request, as it sends it."""
    url, hf, engine = served
    shared = _ids(40, 1)
    ctx, cont = shared + _ids(9, 2)[1:], _ids(5, 3)[1:]
    body = {"prompt": [ctx + cont], "max_tokens": 1, "logprobs": 1, "echo": True}
    body["temperature"] = 0
    errs = []
    for _ in range(2):  # the second request finds every full block of it cached
        r = _post(url, "/v1/completions", body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        n = len(ctx + cont)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n + 1  # prompt + 1 completion
        assert len(lp["text_offset"]) == n + 1 and lp["text_offset"] == sorted(lp["text_offset"])
        errs.append(_echo_errors(hf, ctx + cont, lp))
        # OpenAI's top_logprobs with k = 1: the most likely token, and the token itself
        for p, top in enumerate(lp["top_logprobs"][1:n], start=1):
            assert lp["tokens"][p] in top and 1 <= len(top) <= 2
        # what lm-eval sums: the continuation's logprobs
        total = sum(lp["token_logprobs"][len(ctx) : n])
        ref = _ref(hf, ctx + cont)
        expected = sum(ref[p - 1, (ctx + cont)[p]].item() for p in range(len(ctx), n))
        assert abs(total - expected) <= TOL
    assert max(errs) <= TOL, errs
    # a different continuation of the cached context: still exact
    other = ctx + _ids(7, 4)[1:]
    r = _post(url, "/v1/completions", {**body, "prompt": other})
    assert _echo_errors(hf, other, r.json()["choices"][0]["logprobs"]) <= TOL


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(served):
    url, hf, _ = served
    ids = _ids(23, 5)
    r = _post(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert _echo_errors(hf, ids, choice["logprobs"]) <= TOL
    # echo without logprobs: the prompt's text, then the completion's
    plain = _post(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True}).json()
    assert plain["choices"][0]["text"] == choice["text"] and choice["logprobs"] is not None


def test_max_tokens_zero_without_echo_is_refused(served):
    url, _, engine = served
    r = _post(url, "/v1/completions", {"prompt": [1, 300], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert _post(url, "/v1/completions", {"prompt": [1, 300], "max_tokens": 1}).status_code == 200


def test_vllm_prompt_logprobs_on_completions_and_chat(served):
    url, hf, _ = served
    ids = _ids(30, 6)
    r = _post(url, "/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    ref = _ref(hf, ids)
    assert rows[0] is None and len(rows) == len(ids)
    worst = 0.0
    for p, row in enumerate(rows[1:]):
        top = torch.topk(ref[p], 3).indices.tolist()
        assert set(row) == {str(t) for t in {*top, ids[p + 1]}}
        for t, entry in row.items():
            worst = max(worst, abs(entry["logprob"] - ref[p, int(t)].item()))
        ranked = sorted((e["rank"], t) for t, e in row.items() if e["rank"] is not None)
        assert [int(t) for _, t in ranked] == top
    assert worst <= TOL
    chat = _post(
        url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat.status_code == 200, chat.text
    chat_rows = chat.json()["prompt_logprobs"]
    assert chat_rows[0] is None and all(len(row) == 1 for row in chat_rows[1:])


def _stream(url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"model": NAME, **body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_streamed_echo_equals_the_whole_response(served):
    url, _, _ = served
    ids = _ids(20, 7)
    body = {"prompt": ids, "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0}
    body["ignore_eos"] = True
    whole = _post(url, "/v1/completions", body).json()["choices"][0]
    chunks = [c["choices"][0] for c in _stream(url, body)]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
        assert len(streamed) == len(whole["logprobs"][key]) == len(ids) + 4
        if key != "token_logprobs":
            assert streamed == whole["logprobs"][key], key


def test_completion_top_logprobs_include_the_sampled_token(served):
    url, _, _ = served
    body = {"prompt": _ids(8, 8), "max_tokens": 12, "temperature": 5.0, "seed": 3, "logprobs": 1}
    lp = _post(url, "/v1/completions", {**body, "ignore_eos": True}).json()["choices"][0][
        "logprobs"
    ]
    outside = 0
    for token, chosen, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert top[token] == chosen
        outside += len(top) == 2
    assert outside > 0  # at temperature 5 some draws are not the most likely token
    zero = _post(url, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert all(
        list(top) == [t] for t, top in zip(zero["tokens"], zero["top_logprobs"], strict=True)
    )


def test_batched_prompts_give_prompts_times_n_choices_in_openai_order(served):
    url, _, _ = served
    prompts = [_ids(12, 9), _ids(17, 10), _ids(12, 9)[:7]]
    common = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2}
    alone = [_post(url, "/v1/completions", {**common, "prompt": p, "n": 1}).json() for p in prompts]
    r = _post(url, "/v1/completions", {**common, "prompt": prompts, "logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for c in body["choices"]:
        assert c["text"] == alone[c["index"] // 2]["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert body["usage"]["completion_tokens"] == 6 * 3
    chunks = _stream(url, {**common, "prompt": prompts, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in body["choices"]}
    assert chunks[-1]["usage"]["completion_tokens"] == 18
    words = _post(url, "/v1/completions", {**common, "prompt": ["hello", "a b c"], "n": 1})
    assert [c["index"] for c in words.json()["choices"]] == [0, 1]


def test_batched_echo_scores_each_prompt(served):
    url, hf, _ = served
    prompts = [_ids(10, 11), _ids(21, 12)]
    body = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
    choices = _post(url, "/v1/completions", body).json()["choices"]
    for ids, c in zip(prompts, choices, strict=True):
        assert _echo_errors(hf, ids, c["logprobs"]) <= TOL


def test_a_bad_prompt_in_a_batch_is_400_naming_it_and_the_server_keeps_serving(served):
    url, _, engine = served
    r = _post(url, "/v1/completions", {"prompt": [[1, 300], [1, 99999]], "max_tokens": 2})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt 1:")
    ok = _post(url, "/v1/completions", {"prompt": [[1, 300], [1, 301]], "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
