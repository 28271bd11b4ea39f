"""Completions and chat through the `openai` client, streamed and not, equal token for token to
offline `LLM.generate` for the same prompt and seed (greedy and seeded sampling)."""

from __future__ import annotations

import pytest

from kvpage import SamplingParams
from kvpage.server.chat import simple_template

from .conftest import MODEL

PROMPT = "The paged KV cache keeps every block "
CASES = {  # name -> (sampling params, request fields)
    "greedy": (SamplingParams(max_tokens=24), {"temperature": 0.0}),
    "seeded": (
        SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24),
        {"temperature": 0.9, "top_p": 0.95, "seed": 1234},
    ),
}
TOKEN_IDS = {"return_token_ids": True}


def _expected(offline, prompt: str, params: SamplingParams) -> tuple[list[int], str]:
    out = offline.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.text


@pytest.mark.parametrize("case", CASES)
def test_completion_matches_offline(open_server, offline, case):
    params, fields = CASES[case]
    ids, text = _expected(offline, PROMPT, params)
    r = open_server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, extra_body=TOKEN_IDS, **fields
    )
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == ids
    assert choice.text == text
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.prompt_tokens == len(PROMPT) + 1  # bytes + BOS


@pytest.mark.parametrize("case", CASES)
def test_streamed_completion_matches_offline(open_server, offline, case):
    params, fields = CASES[case]
    ids, text = _expected(offline, PROMPT, params)
    stream = open_server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        stream=True,
        extra_body=TOKEN_IDS,
        stream_options={"include_usage": True},
        **fields,
    )
    chunks = list(stream)
    got_ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert got_ids == ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == len(ids)


@pytest.mark.parametrize("case", CASES)
def test_chat_matches_offline(open_server, offline, case):
    params, fields = CASES[case]
    messages = [
        {"role": "system", "content": "Answer in bytes."},
        {"role": "user", "content": "What is a block table?"},
    ]
    ids, text = _expected(offline, simple_template(messages), params)
    client = open_server.client()
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, extra_body=TOKEN_IDS, **fields
    )
    assert r.choices[0].model_extra["token_ids"] == ids
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, stream=True, extra_body=TOKEN_IDS, **fields
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids", [])] == ids


def test_logprobs(open_server, offline):
    params = SamplingParams(max_tokens=8, logprobs=3)
    expected = offline.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    client = open_server.client()
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for step, top in zip(expected.logprobs, lp.top_logprobs, strict=True):
        assert sorted(top.values()) == pytest.approx(sorted(step.values()), abs=1e-5)
    # greedy: the chosen token is the top-1, so its logprob is known
    assert lp.token_logprobs == pytest.approx([max(s.values()) for s in expected.logprobs])
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_stop_string_truncates(open_server, offline):
    ids, text = _expected(offline, PROMPT, SamplingParams(max_tokens=24))
    printable = [i for i, ch in enumerate(text) if ch.isascii() and ch.isprintable() and i > 2]
    cut = printable[0]
    stop = text[cut]
    want = text[: text.index(stop)]
    client = open_server.client()
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x00never"]
    )
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < len(ids)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert open_server.wait_idle()["private_blocks"] == 0  # the stopped request was aborted


def test_token_id_prompt_and_models(open_server, offline):
    prompt_ids = [256, *b"token ids in"]
    expected = offline.generate(prompt_ids, SamplingParams(max_tokens=6), use_tqdm=False)
    client = open_server.client()
    r = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=6, temperature=0, extra_body=TOKEN_IDS
    )
    assert r.choices[0].model_extra["token_ids"] == expected[0].outputs[0].token_ids
    assert [m.id for m in client.models.list()] == [MODEL]
