"""Completions `top_logprobs` keys never merge two tokens (issue 40): tokens spelled alike (an
added token and a vocabulary piece, a byte-fallback token and the piece it spells) each keep an
entry, the higher-ranked one under the text; the chosen token is spelled as its own key. vLLM's
`return_tokens_as_token_ids` spells every token `token_id:N`."""

from __future__ import annotations

import json
import re

import pytest

from kvpage.server.generation import Delta, TokenLogprobs
from kvpage.server.responses import chunk_body, new_shape

THE, THE_TOO, A = 0, 1, 2  # THE_TOO is another token spelled "the"


class TwinTokenizer:
    """Ids 0 and 1 are both "the" (as an added token may spell a vocabulary piece)."""

    revision, bos_token_id, eos_token_id, vocab_size = "twins", None, None, 3
    _pieces = {THE: b"the", THE_TOO: b"the", A: b" a"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("logprob keys are made from ids: nothing here encodes text")

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._pieces[i] for i in ids).decode()

    def token_bytes(self, token_id: int) -> bytes | None:
        return self._pieces[token_id]


def _logprobs(chosen: int, top: dict[int, float], k: int, chat=False, as_ids=False) -> dict:
    shape = new_shape(chat, "m", k, False, tokens_as_ids=as_ids)
    lp = TokenLogprobs([top], [top[chosen]], [0])
    delta = Delta(0, "the", [chosen], lp, None)
    return chunk_body(shape, delta, TwinTokenizer())["choices"][0]["logprobs"]


def _is_greedy(lp: dict) -> bool:
    """lm-evaluation-harness's test: the chosen token is the top entry's key."""
    top = lp["top_logprobs"][0]
    return max(top, key=top.get) == lp["tokens"][0]


def _own_value(lp: dict) -> float:
    return lp["top_logprobs"][0][lp["tokens"][0]]


TOP = {THE: -0.1, THE_TOO: -2.5, A: -3.0}


def test_twins_keep_both_entries_the_higher_ranked_under_the_text():
    lp = _logprobs(THE, TOP, k=3)
    assert lp["top_logprobs"][0] == {"the": -0.1, "token_id:1": -2.5, " a": -3.0}
    assert lp["tokens"] == ["the"] and _is_greedy(lp) and _own_value(lp) == -0.1


def test_a_lower_ranked_twin_chosen_is_not_greedy_and_reads_its_own_logprob():
    lp = _logprobs(THE_TOO, TOP, k=2)
    assert lp["top_logprobs"][0] == {"the": -0.1, "token_id:1": -2.5}
    assert lp["tokens"] == ["token_id:1"] and lp["token_logprobs"] == [-2.5]
    assert not _is_greedy(lp) and _own_value(lp) == -2.5


def test_a_twin_chosen_outside_the_top_k_is_the_extra_entry():
    top = {THE: -0.1, A: -1.0, THE_TOO: -3.0}
    lp = _logprobs(THE_TOO, top, k=2)
    assert lp["top_logprobs"][0] == {"the": -0.1, " a": -1.0, "token_id:1": -3.0}
    assert not _is_greedy(lp) and _own_value(lp) == -3.0


def test_tokens_as_token_ids_spell_every_token_by_id():
    lp = _logprobs(THE_TOO, TOP, k=3, as_ids=True)
    assert lp["tokens"] == ["token_id:1"]
    assert lp["top_logprobs"][0] == {"token_id:0": -0.1, "token_id:1": -2.5, "token_id:2": -3.0}
    chat = _logprobs(THE_TOO, TOP, k=2, chat=True, as_ids=True)["content"][0]
    assert chat["token"] == "token_id:1" and chat["bytes"] == list(b"the")
    assert [t["token"] for t in chat["top_logprobs"]] == ["token_id:0", "token_id:1"]


def test_chat_alternatives_spelled_alike_stay_two_entries():
    chat = _logprobs(THE, TOP, k=2, chat=True)["content"][0]
    assert [(t["token"], t["logprob"]) for t in chat["top_logprobs"]] == [
        ("the", -0.1),
        ("the", -2.5),
    ]


# --- over HTTP (the built-in byte-level model) -------------------------------------------------
ID = re.compile(r"token_id:(\d+)")


def _ids_of(names: list[str]) -> list[int]:
    matches = [ID.fullmatch(n) for n in names]
    assert all(matches), names
    return [int(m.group(1)) for m in matches]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_return_tokens_as_token_ids(open_server, stream):
    body = {
        "prompt": "Hello",
        "max_tokens": 4,
        "logprobs": 2,
        "echo": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stream": stream,
    }
    r = open_server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = _choices(r, stream)
    lp = {"tokens": [], "top_logprobs": []}
    ids: list[int] = []
    for c in choices:
        ids += c["token_ids"]
        lp["tokens"] += c["logprobs"]["tokens"]
        lp["top_logprobs"] += c["logprobs"]["top_logprobs"]
    assert _ids_of(lp["tokens"]) == ids and len(ids) > 4
    for top in lp["top_logprobs"][1:]:
        assert top and _ids_of(list(top))


def test_chat_return_tokens_as_token_ids(open_server):
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    r = open_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert _ids_of([t["token"] for t in content]) == choice["token_ids"]
    assert all(_ids_of([t["token"] for t in e["top_logprobs"]]) for e in content)


def test_text_spelling_by_default(open_server):
    body = {"prompt": "Hello", "max_tokens": 0, "logprobs": 1, "echo": True}
    r = open_server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"][1:] == list("Hello")


def _choices(r, stream: bool) -> list[dict]:
    if not stream:
        return r.json()["choices"]
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    return [c["choices"][0] for c in chunks if c["choices"]]
