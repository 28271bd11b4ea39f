"""The logprob shapes of real servers, as they answer: each parsed into the same
tokens, logprobs, top-k and output ids, and named by the field they came from."""

from __future__ import annotations

from kvpage.audit.completion import (
    CHAT_SHAPE,
    COMPLETIONS_SHAPE,
    IDS_FIELD,
    IDS_IN_LOGPROBS,
    merge_chunks,
    parse_body,
)


def llama_cpp_entry(tid: int, token: str, lp: float, alts: list[tuple[int, str, float]]) -> dict:
    """One entry of llama.cpp's `probs_vector_to_json` (its /v1/completions logprobs)."""
    top = [{"id": i, "token": t, "bytes": list(t.encode()), "logprob": x} for i, t, x in alts]
    return {
        "id": tid,
        "token": token,
        "bytes": list(token.encode()),
        "logprob": lp,
        "top_logprobs": top,
    }


def test_llama_cpp_completions_come_in_the_chat_shape_with_ids():
    body = {
        "choices": [
            {
                "text": " ab",
                "index": 0,
                "finish_reason": "length",
                "logprobs": {
                    "content": [
                        llama_cpp_entry(301, " a", -0.25, [(301, " a", -0.25), (77, " q", -1.5)]),
                        llama_cpp_entry(9, "b", -0.5, [(9, "b", -0.5), (12, "c", -0.5)]),
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}},
    }
    out = parse_body(body, chat=False)
    assert out.token_ids == [301, 9] and out.logprobs == [-0.25, -0.5]
    assert out.tokens == ["token_id:301", "token_id:9"]  # keyed by id: pieces may collide
    assert out.top[1] == {"token_id:9": -0.5, "token_id:12": -0.5} and out.gap_at(0) == 1.25
    assert (out.logprobs_field, out.ids_field) == (CHAT_SHAPE, IDS_IN_LOGPROBS)
    assert out.cached_tokens == 32


def test_llama_cpp_byte_pieces_that_decode_alike_stay_apart():
    alts = [(200, "\ufffd", -1.0), (201, "\ufffd", -1.5)]
    entry = llama_cpp_entry(200, "\ufffd", -1.0, alts)
    out = parse_body({"choices": [{"text": "?", "logprobs": {"content": [entry]}}]}, chat=False)
    assert out.top[0] == {"token_id:200": -1.0, "token_id:201": -1.5} and out.gap_at(0) == 0.5


def test_vllm_completions_with_return_token_ids():
    body = {
        "choices": [
            {
                "text": "xy",
                "token_ids": [5, 6],
                "prompt_token_ids": [1, 2, 3],
                "logprobs": {
                    "text_offset": [0, 1],
                    "tokens": ["x", "y"],
                    "token_logprobs": [-0.1, -0.2],
                    "top_logprobs": [{"x": -0.1, "z": -3.0}, {"y": -0.2, "w": -0.9}],
                },
            }
        ]
    }
    out = parse_body(body, chat=False)
    assert out.token_ids == [5, 6] and out.ids_field == IDS_FIELD
    assert out.logprobs_field == COMPLETIONS_SHAPE and out.gap_at(1) == 0.7


def test_token_id_spelled_tokens_stay_strings():
    """kvpage and vLLM spell undecodable tokens `token_id:N`, not all of them: ids read from
    some answers and not others would make equal answers differ."""
    lp = {"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-0.1, -0.2]}
    lp["top_logprobs"] = [{"token_id:5": -0.1}, {"token_id:6": -0.2}]
    out = parse_body({"choices": [{"text": "xy", "logprobs": lp}]}, chat=False)
    assert out.token_ids is None and out.units() == ("token", ["token_id:5", "token_id:6"])


def test_sglang_completions_with_null_top_entries():
    lp = {"tokens": ["x", "y"], "token_logprobs": [-0.1, None], "top_logprobs": [None, {"y": -0.2}]}
    out = parse_body({"choices": [{"text": "xy", "logprobs": lp}]}, chat=False)
    assert out.top == [{}, {"y": -0.2}] and out.logprobs[0] == -0.1
    assert out.logprobs[1] != out.logprobs[1]  # null logprob: NaN, skipped by comparisons
    assert out.token_ids is None and out.units() == ("token", ["x", "y"])


def test_transformers_serve_chat_and_a_streamed_chat():
    entry = {"token": "ok", "logprob": -0.3, "top_logprobs": [{"token": "ok", "logprob": -0.3}]}
    body = {
        "choices": [
            {"message": {"role": "assistant", "content": "ok"}, "logprobs": {"content": [entry]}}
        ]
    }
    out = parse_body(body, chat=True)
    assert (out.text, out.tokens, out.logprobs_field, out.token_ids) == (
        "ok",
        ["ok"],
        CHAT_SHAPE,
        None,
    )
    chunks = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {
            "choices": [
                {
                    "delta": {"content": "o"},
                    "logprobs": {"content": [{**entry, "token": "o", "id": 4}]},
                }
            ]
        },
        {
            "choices": [
                {
                    "delta": {"content": "k"},
                    "logprobs": {"content": [{**entry, "token": "k", "id": 5}]},
                    "finish_reason": "length",
                }
            ]
        },
    ]
    merged = merge_chunks(chunks, chat=True)
    assert (merged.text, merged.tokens, merged.token_ids) == ("ok", ["o", "k"], [4, 5])
    assert merged.finish_reason == "length" and merged.ids_field == IDS_IN_LOGPROBS
