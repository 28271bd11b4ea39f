"""`n` on the server: one choice per sample, `index` = the sample's index, each equal token for
token to offline `LLM.generate` and to the contiguous reference run alone with the sample's seed;
usage sums every choice; streamed chunks name their choice; 1 <= n <= 16."""

from __future__ import annotations

import json

import pytest

from kvpage import SamplingParams
from kvpage.reference.generator import generate

from .conftest import MODEL

PROMPT = "Parallel samples share the prompt's blocks "
N = 3
PARAMS = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=16, n=N)
FIELDS = {"temperature": 0.9, "top_p": 0.95, "seed": 77, "n": N}
TOKEN_IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def expected(offline) -> list[tuple[list[int], str, str]]:
    """(token ids, text, finish reason) per sample, checked against the reference first."""
    (out,) = offline.generate(PROMPT, PARAMS, use_tqdm=False)
    assert [c.index for c in out.outputs] == list(range(N))
    model = offline.engine.model
    for c in out.outputs:
        ref = generate(model, out.prompt_token_ids, PARAMS.for_sample(c.index))
        assert c.token_ids == ref.token_ids, f"offline sample {c.index} != reference"
        assert c.finish_reason == ref.finish_reason
    assert len({tuple(c.token_ids) for c in out.outputs}) == N, "samples should differ"
    return [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]


def test_completion_n_choices(open_server, expected):
    r = open_server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, extra_body=TOKEN_IDS, **FIELDS
    )
    assert [c.index for c in r.choices] == list(range(N))
    for c, (ids, text, finish) in zip(r.choices, expected, strict=True):
        assert c.model_extra["token_ids"] == ids, f"choice {c.index}"
        assert (c.text, c.finish_reason) == (text, finish)
    assert r.usage.completion_tokens == sum(len(e[0]) for e in expected)
    assert open_server.wait_idle()["private_blocks"] == 0


def test_streamed_completion_n_choices(open_server, expected):
    stream = open_server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        stream=True,
        extra_body=TOKEN_IDS,
        stream_options={"include_usage": True},
        **FIELDS,
    )
    chunks = list(stream)
    ids: dict[int, list[int]] = {i: [] for i in range(N)}
    text: dict[int, str] = {i: "" for i in range(N)}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            assert len(chunk.choices) == 1
            ids[c.index] += c.model_extra["token_ids"]
            text[c.index] += c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert [ids[i] for i in range(N)] == [e[0] for e in expected]
    assert [text[i] for i in range(N)] == [e[1] for e in expected]
    assert [finish[i] for i in range(N)] == [e[2] for e in expected]
    assert chunks[-1].usage.completion_tokens == sum(len(e[0]) for e in expected)


def test_chat_n_choices(open_server, offline):
    messages = [{"role": "user", "content": "Two answers, please."}]
    client = open_server.client()
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, extra_body=TOKEN_IDS, **{**FIELDS, "n": 2}
    )
    prompt_ids = offline.engine.prompt_ids("<|user|>\nTwo answers, please.\n<|assistant|>\n")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=8, n=2)
    model = offline.engine.model
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        want = generate(model, prompt_ids, params.for_sample(c.index)).token_ids
        assert c.model_extra["token_ids"] == want
        assert c.message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stream=True, **{**FIELDS, "n": 2}
    )
    chunks = list(stream)
    roles = [c.index for ch in chunks for c in ch.choices if c.delta.role == "assistant"]
    assert roles == [0, 1]
    for c in r.choices:
        streamed = "".join(
            x.delta.content or "" for ch in chunks for x in ch.choices if x.index == c.index
        )
        assert streamed == c.message.content


def test_stop_string_ends_one_choice(open_server, expected):
    """A stop string ends the choice it appears in (that sample is aborted in the engine); the
    other choices run on, and every block comes back."""
    text1 = expected[1][1]
    at = next(i for i, ch in enumerate(text1) if i > 2 and ch.isascii() and ch.isprintable())
    stop = text1[at]
    r = open_server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, stop=[stop], **FIELDS
    )
    for c, (_, text, finish) in zip(r.choices, expected, strict=True):
        if stop in text:
            assert (c.text, c.finish_reason) == (text[: text.index(stop)], "stop")
        else:
            assert (c.text, c.finish_reason) == (text, finish)
    assert r.choices[1].finish_reason == "stop"
    stats = open_server.wait_idle()
    assert stats["private_blocks"] == stats["shared_blocks"] == 0
    lines = [json.loads(line) for line in open_server.audit_path.read_text().splitlines()]
    frees = {e["sample_id"]: e["reason"] for e in lines if e["event"] == "free"}
    assert frees[f"{r.id}#1"] == "abort"  # the stopped sample, on its own
    assert set(frees) >= {f"{r.id}#{i}" for i in range(N)}


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_400_naming_n(open_server, n):
    r = open_server.post("/v1/completions", {"prompt": "x", "n": n})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"
    assert "16" in r.json()["error"]["message"]
