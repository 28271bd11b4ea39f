"""Tool calls on chat (issue 43 item 4). The hermes parser on crafted text, whole and streamed in
pieces split at every position (the stream, put back together, must say what the whole text
says); the required and named stream readers likewise; tool_choice's rules (vLLM's). Then against
a live server on a random-weight model with a real BPE tokenizer and a Qwen-style template that
renders `tools`: a named tool choice and "required" return tool_calls whose arguments validate
(`jsonschema`) against the tool's parameters, streamed and not; "auto" with the hermes parser
extracts the `<tool_call>` blocks a regex makes the model write; refusals are 400s naming the
field, and the server serves the next request. Last, the real `kvpage serve` process with
`--enable-auto-tool-choice --tool-call-parser hermes`, through the openai client (named calls,
streamed hermes calls, `chat.completions.parse` with a pydantic model)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvpage import EngineConfig, LLMEngine
from kvpage.cli import build_parser
from kvpage.cli.common import CliError
from kvpage.cli.serve import server_options
from kvpage.model.tokenizer import HFTokenizer
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer
from kvpage.server.hermes import HermesStream, parse_hermes
from kvpage.server.protocol import ApiError, ChatCompletionRequest
from kvpage.server.text_stream import TextStream, prompt_context
from kvpage.server.tool_calls import ToolPolicy, required_schema, tool_policy

from ..real_servers.models import CLIENT_TINY, build
from ..real_servers.process import free_port, serve_process
from ..waiting import READY_S

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris for three days?"}]
# Qwen2.5's shape: the tools as JSON in a system turn, and the <tool_call> instruction
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools>\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --- the hermes parser --------------------------------------------------------------------------
CALL_A = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
CALL_B = '<tool_call>{"name":"get_time","arguments":{"zone":"U\\"TC}"}}</tool_call>'
NOT_A_CALL = "<tool_call>not json</tool_call>"
TEXTS = [
    "Let me look. " + CALL_A,
    CALL_A + "\n" + CALL_B,
    "a < b <tool and " + CALL_B + " done",
    "text " + NOT_A_CALL + " more",
    "no calls at all, though <tool_ca",
    CALL_B + "<tool_call>{'unclosed",
    '<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>',  # args first
    '<tool_call>{"name": "get_time", "arguments": 7}</tool_call>',  # a scalar
]


def _whole(text: str) -> tuple[str | None, list[tuple[str, object]]]:
    content, calls = parse_hermes(text)
    named = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
    return content, named


def _streamed(pieces: list[str]) -> tuple[str | None, list[tuple[str, object]]]:
    """The stream's deltas put back together as a client does (by call index)."""
    stream, content, calls = HermesStream(), "", {}
    for i, piece in enumerate(pieces):
        said, entries = stream.feed(piece, final=i == len(pieces) - 1)
        content += said
        for entry in entries:
            call = calls.setdefault(entry["index"], {"name": None, "arguments": ""})
            if "id" in entry:  # a call's first delta: id, type, name, arguments so far
                assert call["name"] is None and entry["type"] == "function"
                assert entry["id"].startswith("call_")
                call["name"] = entry["function"]["name"]
            call["arguments"] += entry["function"]["arguments"]
    named = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return (content if calls and content.strip() else None) if calls else content, named


def test_hermes_parses_whole_replies():
    content, calls = _whole(TEXTS[0])
    assert content == "Let me look. "
    assert calls == [("get_weather", {"city": "Paris", "days": 3})]
    assert _whole(TEXTS[1]) == (None, [calls[0], ("get_time", {"zone": 'U"TC}'})])
    assert _whole(TEXTS[3]) == (TEXTS[3], [])  # a block that is no call stays text
    assert _whole(TEXTS[4]) == (TEXTS[4], [])
    assert _whole(TEXTS[6]) == (None, [("get_time", {"zone": "CET"})])


@pytest.mark.parametrize("text", TEXTS)
def test_hermes_stream_split_anywhere_says_what_the_whole_says(text):
    whole = _whole(text)
    assert _streamed([text]) == whole
    assert _streamed(list(text)) == whole  # one character at a time
    for at in range(len(text) + 1):
        assert _streamed([text[:at], text[at:]]) == whole, at


def test_hermes_stream_sends_content_before_the_call_and_arguments_in_fragments():
    stream = HermesStream()
    said, entries = stream.feed("Sure <tool")
    assert (said, entries) == ("Sure ", [])  # "<tool" may begin a call: held back
    said, entries = stream.feed('_call>{"name": "get_time", "arguments": {"zo')
    assert said == ""
    header, fragment = entries
    assert header["function"] == {"name": "get_time", "arguments": ""} and header["index"] == 0
    assert fragment == {"index": 0, "function": {"arguments": '{"zo'}}
    said, entries = stream.feed('ne": "UTC"}}</tool_call> bye', final=True)
    assert said == " bye"
    assert entries == [{"index": 0, "function": {"arguments": 'ne": "UTC"}'}}]


# --- the constrained readers (required, named) --------------------------------------------------
def _read(policy: ToolPolicy, pieces: list[str]) -> list[tuple[str, object]]:
    stream, calls = policy.stream(), {}
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        assert "content" not in delta
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"name": None, "arguments": ""})
            if "id" in entry:
                call["name"] = entry["function"]["name"]
            call["arguments"] += entry["function"]["arguments"]
    assert stream.called == bool(calls)
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def test_required_and_named_streams_split_anywhere():
    required = ToolPolicy("required")
    text = '[ {"name": "get_time", "parameters": {"zone": "CET"}},\n{"name":"get_weather","parameters":{"city":"Oslo","days":2}}]'
    expected = [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Oslo", "days": 2})]
    message, finish = required.message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    whole = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert whole == expected
    named = ToolPolicy("named", "get_time")
    args = '{"zone" : "UTC"}'
    for at in range(len(text) + 1):
        assert _read(required, [text[:at], text[at:]]) == expected, at
    for at in range(len(args) + 1):
        assert _read(named, [args[:at], args[at:]]) == [("get_time", {"zone": "UTC"})], at
    reordered = '[{"parameters": {"zone": "UTC"}, "name": "get_time"}]'  # sent once whole
    for at in range(len(reordered) + 1):
        parts = [reordered[:at], reordered[at:]]
        assert _read(required, parts) == [("get_time", {"zone": "UTC"})], at
    stream = required.stream()  # the header as soon as the name is whole, then fragments
    (first,) = stream.feed('[{"name": "get_time", "parameters": {"zo', False)["tool_calls"]
    assert first["function"] == {"name": "get_time", "arguments": '{"zo'} and "id" in first
    rest = stream.feed('ne": "UTC"} }]', True)["tool_calls"]
    assert rest == [{"index": 0, "function": {"arguments": 'ne": "UTC"}'}}]
    cut, finish = named.message('{"zone": "U', "length")  # max_tokens cut the arguments
    assert cut == {"role": "assistant", "content": '{"zone": "U'} and finish == "length"


# --- tool_choice's rules -------------------------------------------------------------------------
def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def test_tool_choice_rules():
    named = {"type": "function", "function": {"name": "get_time"}}
    assert tool_policy(_request(tools=TOOLS), None).mode == "none"  # no parser: as before
    assert tool_policy(_request(tools=TOOLS), "hermes").mode == "auto"  # vLLM's default
    assert tool_policy(_request(tools=TOOLS, tool_choice="none"), "hermes").mode == "none"
    assert tool_policy(_request(tools=[], tool_choice="required"), None).mode == "none"
    policy = tool_policy(_request(tools=TOOLS, tool_choice=named), None)
    assert (policy.mode, policy.name) == ("named", "get_time")
    assert json.loads(policy.constraint.params.json) == TIME
    refusals = [  # (fields, parser, param, words)
        ({"tool_choice": "required"}, None, "tools", "needs tools"),
        ({"tool_choice": named}, "hermes", "tools", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "auto"}, None, "tool_choice", "--enable-auto-tool-choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            None,
            "tool_choice",
            "'nope', which does not match any of the tools (get_time, get_weather)",
        ),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, None, "tools", "tools.0"),
    ]
    for fields, parser, param, words in refusals:
        with pytest.raises(ApiError) as caught:
            tool_policy(_request(**fields), parser)
        assert caught.value.param == param and words in caught.value.message, caught.value.message


def test_serve_flags(tmp_path):
    """vLLM's flags: --enable-auto-tool-choice needs --tool-call-parser; hermes is the parser."""
    base = ["serve", "--model", "builtin:tiny-llama", "--audit-log", str(tmp_path / "a.jsonl")]
    options = server_options(build_parser().parse_args(base))
    assert options.auto_tool_parser is None
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    options = server_options(build_parser().parse_args([*base, *flags]))
    assert options.auto_tool_parser == "hermes"
    with pytest.raises(CliError, match="needs --tool-call-parser"):
        server_options(build_parser().parse_args([*base, "--enable-auto-tool-choice"]))
    with pytest.raises(CliError, match="invalid choice: 'mistral'"):
        build_parser().parse_args([*base, "--tool-call-parser", "mistral"])


def test_required_schema_is_vllms():
    defs = {"Zone": {"enum": ["UTC"]}}
    tools = {"f": {"type": "object", "$defs": defs, "properties": {"z": {"$ref": "#/$defs/Zone"}}}}
    schema = required_schema({**tools, "g": None})
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["$defs"] == defs
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert "$defs" not in first["properties"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    good = [{"name": "f", "parameters": {"z": "UTC"}}, {"name": "g", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {"z": "x"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


# --- against a live server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    spec = replace(CLIENT_TINY, name="tool-tiny", max_position_embeddings=2048)
    return build(tmp_path_factory.mktemp("tool-model"), spec)


def test_a_long_byte_run_streams_as_it_decodes_whole(model_dir):
    """JSON whitespace on this byte-fallback tokenizer is one long run of byte tokens, after a
    prompt whose "▁" is three byte tokens: the stream's window, moved along the run, must not
    start on a continuation byte (the decoder would turn the whole run into U+FFFD)."""
    tokenizer = HFTokenizer(model_dir / "tokenizer.json", None, None)
    prompt = tokenizer.encode("for three days?\n", add_special_tokens=False)
    reply = (
        '{ \n\n\r\t \n\n"city" \r  \r :\n"Paris" \t \r \r \r\t , \t "days" \n\t \r\t \r: 3 }' * 3
    )
    byte_ids = {  # what a model writes: each byte its <0xNN> token
        tokenizer.token_bytes(i): i
        for i in range(tokenizer.vocab_size)
        if tokenizer.is_fallback_byte(i)
    }
    ids = [byte_ids[bytes([b])] for b in reply.encode()]
    stream = TextStream(tokenizer, [], context=prompt_context(prompt, tokenizer))
    text = "".join(stream.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert text == tokenizer.decode(ids) == reply


@pytest.fixture(scope="module")
def url(model_dir) -> Iterator[str]:
    directory = model_dir
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": TEMPLATE}))
    engine = LLMEngine(EngineConfig(model=str(directory), num_blocks=512, max_model_len=2048))
    options = ServerOptions(
        model_name="m", shadow_rate=0.0, enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    with BackgroundServer(create_app(engine, options)) as bg:
        yield bg.url


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{CHAT}", json={"messages": MESSAGES, **body}, timeout=120)


def _calls_of(message: dict) -> list[tuple[str, dict]]:
    calls = []
    for call in message.get("tool_calls") or []:
        assert call["id"].startswith("call_") and call["type"] == "function"
        calls.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    return calls


def _stream(url: str, body: dict) -> list[SimpleNamespace]:
    """Each choice of a stream put back together: content, calls, finish reason."""
    r = _post(url, {**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices: dict[int, SimpleNamespace] = {}
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            got = choices.setdefault(c["index"], SimpleNamespace(content="", calls={}, finish=None))
            got.content += c["delta"].get("content") or ""
            for entry in c["delta"].get("tool_calls", []):
                call = got.calls.setdefault(entry["index"], {"name": None, "arguments": ""})
                if "id" in entry:
                    assert call["name"] is None and entry["id"].startswith("call_")
                    call["name"] = entry["function"]["name"]
                call["arguments"] += entry["function"].get("arguments", "")
            if c["finish_reason"] is not None:
                got.finish = c["finish_reason"]
    for got in choices.values():
        got.calls = [(c["name"], c["arguments"]) for _, c in sorted(got.calls.items())]
    return [choices[i] for i in sorted(choices)]


def _validate_calls(calls: list[tuple[str, dict]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names, name
        jsonschema.validate(arguments, PARAMETERS[name])


def test_tools_reach_the_template(url):
    r = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES, "tools": TOOLS}, timeout=60)
    plain = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, timeout=60)
    ids = r.json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert "get_weather" in text and "get_time" in text and "<tool_call></tool_call>" in text
    usage = _post(url, {"tools": TOOLS, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(ids) > plain.json()["count"]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_tool_choice_returns_a_call_whose_arguments_validate(url):
    r = _post(url, {"tools": TOOLS, "tool_choice": NAMED, "max_tokens": 200, "n": 4, "seed": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    called = [c for c in choices if c["finish_reason"] == "tool_calls"]
    assert 2 * len(called) >= len(choices), choices
    for c in called:
        assert c["message"]["content"] is None
        calls = _calls_of(c["message"])
        assert len(calls) == 1
        _validate_calls(calls, {"get_weather"})
    for c in choices:
        if c["finish_reason"] != "tool_calls":  # cut by max_tokens: the text, no call
            assert c["finish_reason"] == "length" and "tool_calls" not in c["message"]


def test_named_tool_choice_streamed(url):
    body = {"tools": TOOLS, "tool_choice": NAMED, "max_tokens": 200, "n": 4, "seed": 2}
    choices = _stream(url, body)
    finished = [c for c in choices if c.finish == "tool_calls"]
    assert 2 * len(finished) >= len(choices)
    for c in choices:
        assert c.content == "" and len(c.calls) == 1 and c.calls[0][0] == "get_weather"
    for c in finished:
        _validate_calls([(n, json.loads(a)) for n, a in c.calls], {"get_weather"})


def test_named_tool_choice_through_the_openai_client(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    done = []
    for seed in range(3):
        completion = client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=NAMED,
            max_tokens=200,
            seed=seed,
        )
        choice = completion.choices[0]
        if choice.finish_reason == "tool_calls":
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
            done.append(call)
    assert done


def test_required_tool_choice_returns_calls_of_the_tools(url):
    body = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 300, "n": 4, "seed": 3}
    r = _post(url, body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    called = [c for c in choices if c["finish_reason"] == "tool_calls"]
    assert 2 * len(called) >= len(choices), choices
    for c in called:
        assert c["message"]["content"] is None
        _validate_calls(_calls_of(c["message"]), set(PARAMETERS))
    for c in _stream(url, {**body, "seed": 4}):
        if c.finish == "tool_calls":
            _validate_calls([(n, json.loads(a)) for n, a in c.calls], set(PARAMETERS))
        assert c.content == ""


# A reply the model must write (the regex), read by the hermes parser as auto's calls are
# (no spaces: this test tokenizer spells them as byte-fallback "▁", which llguidance reads as a
# space and kvpage's decode does not)
HERMES_REPLY = (
    r'Sure\.<tool_call>\{"name":"get_(weather|time)","arguments":'
    r'\{"(city|zone)":"(Paris|UTC)"\}\}</tool_call>'
)


def test_auto_tool_choice_parses_hermes_calls(url):
    body = {"tools": TOOLS, "structured_outputs": {"regex": HERMES_REPLY}, "max_tokens": 120}
    r = _post(url, {**body, "tool_choice": "auto", "n": 2, "seed": 5})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] == "Sure."
        ((name, arguments),) = _calls_of(choice["message"])
        assert name in PARAMETERS and len(arguments) == 1
    streamed = _stream(url, {**body, "seed": 6})  # the default with tools: auto
    (choice,) = streamed
    assert choice.finish == "tool_calls" and choice.content == "Sure."
    ((name, arguments),) = choice.calls
    assert name in PARAMETERS and len(json.loads(arguments)) == 1
    none = _post(url, {**body, "tool_choice": "none", "seed": 6}).json()["choices"][0]
    assert none["finish_reason"] == "stop" and none["message"]["content"].startswith(
        "Sure.<tool_call>"
    )
    assert "tool_calls" not in none["message"]


REFUSED = [  # (body, param, words)
    ({"tool_choice": "required"}, "tools", "needs tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
        "'x'",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "send one of them",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "nah"}}}
            ],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tool_choice",
        "tools.0.function.parameters",
    ),
]


@pytest.mark.parametrize(("body", "param", "words"), REFUSED)
def test_bad_tool_choice_is_400_and_the_server_goes_on(url, body, param, words):
    r = _post(url, {**body, "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    after = _post(url, {"tools": TOOLS, "tool_choice": NAMED, "max_tokens": 200, "seed": 1})
    assert after.status_code == 200 and after.json()["choices"][0]["message"].get("tool_calls")


def test_kvpage_serve_with_the_hermes_parser(model_dir, tmp_path):
    """The real `kvpage serve` process with vLLM's flags, through the openai client: a named
    tool call whose arguments validate, and auto's hermes calls streamed as deltas."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvpage.cli", "serve", "--model", str(model_dir)]
    cmd += ["--port", str(port), "--num-blocks", "256"]
    cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    cmd += ["--audit-log", str(tmp_path / "audit.jsonl"), "--shadow-rate", "0"]
    with serve_process(cmd, dict(os.environ), url, tmp_path / "serve.log", READY_S):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        called = []
        for seed in range(3):
            choice = client.chat.completions.create(
                model=str(model_dir),
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=NAMED,
                max_tokens=200,
                seed=seed,
            ).choices[0]
            if choice.finish_reason == "tool_calls":
                (call,) = choice.message.tool_calls
                jsonschema.validate(json.loads(call.function.arguments), WEATHER)
                called.append(call)
        assert called
        stream = client.chat.completions.create(
            model=str(model_dir),
            messages=MESSAGES,
            tools=TOOLS,
            max_tokens=120,
            seed=7,
            stream=True,
            extra_body={"structured_outputs": {"regex": HERMES_REPLY}},
        )
        content, calls, finish = "", {}, None
        for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for entry in delta.tool_calls or []:
                call = calls.setdefault(entry.index, {"name": "", "arguments": ""})
                call["name"] += entry.function.name or ""
                call["arguments"] += entry.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and content == "Sure."
        ((_, call),) = calls.items()
        assert call["name"] in PARAMETERS and len(json.loads(call["arguments"])) == 1
        parsed = []  # the openai SDK's structured outputs, against the same process
        for seed in range(4):
            try:
                completion = client.chat.completions.parse(
                    model=str(model_dir),
                    messages=MESSAGES,
                    response_format=Forecast,
                    max_tokens=200,
                    seed=seed,
                )
            except openai.LengthFinishReasonError:  # whitespace to max_tokens: a random model's
                continue
            parsed.append(completion.choices[0].message.parsed)
        assert parsed and all(isinstance(p, Forecast) for p in parsed)


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)
