"""Chat templates as transformers resolves and renders them (issue 40 item 3): the prompt ids the
server takes equal `AutoTokenizer.from_pretrained(dir).apply_chat_template(...)`'s on a
SentencePiece-style and a byte-level BPE directory (tests/verify/stack_dirs.py), with the template
in chat_template.jinja or tokenizer_config.json, writing BOS or not; a template's refusal
(`raise_exception`) is a 400 naming it and the server goes on; named templates, tools selecting
"tool_use", additional_chat_templates/, --chat-template as a file or a string; tools, documents,
tool calls, chat_template_kwargs and continue_final_message reach the template as transformers
passes them; a bounded schemathesis run against a server whose template refuses finds no 5xx."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import jinja2
import pytest
import schemathesis
import transformers
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance
from schemathesis.config import SchemathesisConfig

from kvpage import EngineConfig, LLMEngine
from kvpage.cli import build_parser
from kvpage.cli.common import CliError
from kvpage.cli.serve import server_options
from kvpage.model import load_tokenizer
from kvpage.serve_replicas.routing_key import RoutingKeys
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer
from kvpage.server.chat import ChatTemplateInvalid, load_chat_template
from kvpage.server.tenants import Tenants

from ..verify.stack_dirs import build
from .schema_fuzz import beyond_schema

# Turns as Llama-2-style chat templates write them, with what the old renderer lacked: the
# loopcontrols extension (a developer message skipped with `continue`), `pad_token`, and
# transformers' `tojson` (Jinja's own escapes `<` and `&`).
TURNS = (
    "{% for m in messages %}{% if m['role'] == 'developer' %}{% continue %}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% if m.name is defined %}{{ m.name | tojson }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{{ pad_token }}\n{% endif %}"
)
TEMPLATES = {"with_bos": "{{ bos_token }}" + TURNS, "without_bos": TURNS}
MESSAGES = [
    {"role": "system", "content": "You are terse: <b>& no more</b>."},
    {"role": "developer", "content": "left out by the template"},
    {"role": "user", "content": "héllo wörld, the cat sat on the mat", "name": "<ann>"},
    {"role": "assistant", "content": "the dog ran to the park"},
    {"role": "user", "content": "and back? 😀"},
]
# Mistral's v0.1 template, in the shape of its checks: no system message, roles alternating.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ raise_exception('System messages are not supported by this template') }}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
USER_ONLY = [{"role": "user", "content": "the cat sat"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather <now> in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
DOCUMENT = {"title": "Park", "text": "the dog ran to the park and back"}
# A tool-use template in the shape of Llama 3.1's and Qwen's: tools as JSON, documents, calls.
TOOL_USE = (
    "{{ bos_token }}{% if tools %}<|tools|>{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "{% endif %}{% if documents %}{% for d in documents %}<|doc|>{{ d.title }}: {{ d.text }}\n"
    "{% endfor %}{% endif %}{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.content is defined %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<|call|>{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "[{{ c.function.arguments.city }}]{% endfor %}"
    "{% if m.tool_call_id is defined %}({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-template-dirs")
    return {kind: build(root / kind, kind) for kind in ("spm", "bpe")}


def _model(
    built: dict[str, Path],
    tmp_path: Path,
    kind: str = "spm",
    config_template: str | list | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """A copy of the `kind` directory whose templates are exactly these: tokenizer_config.json's
    `chat_template` (None: none) and template files (relative path -> text)."""
    directory = tmp_path / kind
    shutil.copytree(built[kind], directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    if config_template is not None:
        config["chat_template"] = config_template
    config_path.write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    return directory


@contextmanager
def _serve(directory: Path | str, **options) -> Iterator[str]:
    engine = LLMEngine(EngineConfig(model=str(directory), num_blocks=48, max_model_len=384))
    app = create_app(engine, ServerOptions(model_name="m", shadow_rate=0.0, **options))
    with BackgroundServer(app) as bg:
        yield bg.url


def _hf_ids(directory: Path, messages: list[dict], **kwargs) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    kwargs.setdefault("add_generation_prompt", True)
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def _tokenize(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/tokenize", json=body, timeout=60)


def _chat(url: str, body: dict) -> httpx.Response:
    body = {"max_tokens": 1, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _server_prompt_ids(url: str, body: dict) -> list[int]:
    """The prompt the server took, told three ways that must agree: /tokenize's ids, a chat's
    usage.prompt_tokens, and the ids keying each of the chat's prompt_logprobs (top 0)."""
    tokenized = _tokenize(url, body)
    assert tokenized.status_code == 200, tokenized.text
    ids = tokenized.json()["tokens"]
    chat = _chat(url, {**body, "prompt_logprobs": 0, "return_token_ids": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    rows = chat.json()["prompt_logprobs"]
    assert rows[0] is None and [int(next(iter(row))) for row in rows[1:]] == ids[1:]
    assert len(chat.json()["choices"][0]["token_ids"]) == 1
    return ids


# --- the prompt ids, as transformers' ----------------------------------------------------------
@pytest.mark.parametrize("kind", ["spm", "bpe"])
@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
@pytest.mark.parametrize("bos", sorted(TEMPLATES))
def test_prompt_ids_equal_transformers_apply_chat_template(built, tmp_path, kind, where, bos):
    template = TEMPLATES[bos]
    if where == "chat_template.jinja":  # the config's template differs: the file must win
        directory = _model(built, tmp_path, kind, "{{ 'ignored' }}", {where: template})
    else:
        directory = _model(built, tmp_path, kind, template)
    expected = _hf_ids(directory, MESSAGES)
    bos_id = 1  # both directories' BOS
    assert expected.count(bos_id) == (bos == "with_bos")  # the template decides, once
    with _serve(directory) as url:
        assert _server_prompt_ids(url, {"messages": MESSAGES}) == expected


def test_the_rendered_text_keeps_html_characters_and_skips_with_continue(built, tmp_path):
    directory = _model(built, tmp_path, "bpe", TEMPLATES["without_bos"])
    with _serve(directory) as url:
        r = _tokenize(url, {"messages": MESSAGES, "return_token_strs": True})
    text, ids = "".join(r.json()["token_strs"]), r.json()["tokens"]
    assert "terse: <b>& no more</b>." in text and '"<ann>"' in text and "left out" not in text
    assert ids[-2] == 2  # pad_token: the byte-level directory's <|end_of_text|>


# --- a template's refusal --------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_a_template_refusal_is_a_400_naming_it_and_the_server_goes_on(built, tmp_path, kind):
    directory = _model(built, tmp_path, kind, files={"chat_template.jinja": MISTRAL})
    system = [{"role": "system", "content": "be terse"}, *USER_ONLY]
    out_of_order = [{"role": "assistant", "content": "hi"}, *USER_ONLY]
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    with pytest.raises(jinja2.TemplateError, match="System messages are not supported"):
        tok.apply_chat_template(system, add_generation_prompt=True)
    with _serve(directory) as url:
        for messages, why in [
            (system, "System messages are not supported by this template"),
            (out_of_order, "Conversation roles must alternate user/assistant/user/assistant/..."),
        ]:
            for post in (_chat, _tokenize):
                r = post(url, {"messages": messages})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["message"] == f"the chat template refused the conversation: {why}"
                assert (error["param"], error["type"]) == ("messages", "invalid_request_error")
        assert _server_prompt_ids(url, {"messages": USER_ONLY}) == _hf_ids(directory, USER_ONLY)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_a_template_failing_on_a_conversation_is_a_400(built, tmp_path):
    """Not a raise_exception: an undefined name dereferenced, and a Python error (TypeError)."""
    template = (
        "{% if messages | length > 1 %}{{ messages[0].content + 1 }}{% endif %}"
        "{% if messages[0].role == 'system' %}{{ messages[0].missing.deeper }}{% endif %}"
        "{{ messages[0].content.upper() }}"
    )
    directory = _model(built, tmp_path, "spm", template)
    system = {"role": "system", "content": "be terse"}
    with _serve(directory) as url:
        for messages, message in [
            ([system], "refused the conversation: 'dict object' has no attribute 'missing'"),
            ([system, *USER_ONLY], "failed on the conversation: TypeError: can only concatenate"),
        ]:
            r = _chat(url, {"messages": messages})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"].startswith(f"the chat template {message}")
        assert _server_prompt_ids(url, {"messages": USER_ONLY}) == _hf_ids(directory, USER_ONLY)


def test_a_template_that_does_not_compile_stops_the_server_before_the_model_loads(built, tmp_path):
    directory = _model(built, tmp_path, "spm", files={"chat_template.jinja": "{% for m in %}"})
    args = build_parser().parse_args(["serve", "--model", str(directory)])
    with pytest.raises(CliError, match=r"chat template from .* does not compile: .*\(line 1\)"):
        server_options(args)
    with pytest.raises(ChatTemplateInvalid, match="does not compile"):
        create_app(LLMEngine(EngineConfig(model=str(directory), num_blocks=16)))


# --- which template ----------------------------------------------------------------------------
def test_named_templates_tools_select_tool_use_and_a_request_may_name_one(built, tmp_path):
    named = [
        {"name": "default", "template": TEMPLATES["with_bos"]},
        {"name": "tool_use", "template": TOOL_USE},
    ]
    directory = _model(built, tmp_path, "spm", named)
    with _serve(directory) as url:
        plain = _server_prompt_ids(url, {"messages": USER_ONLY})
        assert plain == _hf_ids(directory, USER_ONLY)
        tools = _server_prompt_ids(url, {"messages": USER_ONLY, "tools": [TOOL]})
        assert tools == _hf_ids(directory, USER_ONLY, tools=[TOOL]) != plain
        by_name = _server_prompt_ids(url, {"messages": USER_ONLY, "chat_template": "tool_use"})
        assert by_name == _hf_ids(directory, USER_ONLY, chat_template="tool_use") != plain
        r = _chat(url, {"messages": USER_ONLY, "chat_template": "{{ messages }}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert "default, tool_use" in r.json()["error"]["message"]


def test_jinja_files_with_additional_templates_replace_the_configs(built, tmp_path):
    files = {
        "chat_template.jinja": TEMPLATES["without_bos"],
        "additional_chat_templates/tool_use.jinja": TOOL_USE,
    }
    directory = _model(built, tmp_path, "bpe", [{"name": "default", "template": "x"}], files)
    with _serve(directory) as url:
        assert _server_prompt_ids(url, {"messages": MESSAGES}) == _hf_ids(directory, MESSAGES)
        body = {"messages": USER_ONLY, "tools": [TOOL]}
        assert _server_prompt_ids(url, body) == _hf_ids(directory, USER_ONLY, tools=[TOOL])


def test_several_templates_and_no_default_need_a_name(built, tmp_path):
    named = [{"name": "a", "template": TEMPLATES["with_bos"]}, {"name": "b", "template": TURNS}]
    directory = _model(built, tmp_path, "spm", named)
    with _serve(directory) as url:
        r = _tokenize(url, {"messages": USER_ONLY})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        body = {"messages": USER_ONLY, "chat_template": "b"}
        assert _server_prompt_ids(url, body) == _hf_ids(directory, USER_ONLY, chat_template="b")


@pytest.mark.parametrize("form", ["file", "string"])
def test_chat_template_option_overrides_the_models(built, tmp_path, form):
    directory = _model(built, tmp_path, "bpe", MISTRAL)  # refuses a system message
    override = TEMPLATES["with_bos"]
    if form == "file":
        path = tmp_path / "override.jinja"
        path.write_text(override)
        value = str(path)
    else:  # typed on a command line: the newlines as `\n`
        value = override.replace("\n", "\\n")
    args = build_parser().parse_args(["serve", "--model", str(directory), "--chat-template", value])
    options = server_options(args)
    assert options.chat_template == override
    with _serve(directory, chat_template=options.chat_template) as url:
        ids = _server_prompt_ids(url, {"messages": MESSAGES})
    assert ids == _hf_ids(directory, MESSAGES, chat_template=override)
    missing = ["serve", "--model", str(directory), "--chat-template", str(tmp_path / "nope")]
    with pytest.raises(CliError, match="looks like a file path"):
        server_options(build_parser().parse_args(missing))


def test_chat_template_option_gives_a_built_in_model_a_template():
    with _serve("builtin:tiny-llama", chat_template="[{{ messages[0].content }}]") as url:
        assert _tokenize(url, {"messages": USER_ONLY}).json()["tokens"] == list(b"[the cat sat]")


# --- what reaches the template -----------------------------------------------------------------
def test_tools_documents_and_tool_calls_reach_the_template(built, tmp_path):
    directory = _model(built, tmp_path, "spm", files={"chat_template.jinja": TOOL_USE})
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        *USER_ONLY,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    # As vLLM hands them over: null keys left out, a call's JSON arguments as a dict.
    hf_call = {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    hf_messages = [*USER_ONLY, {"role": "assistant", "tool_calls": [hf_call]}, messages[2]]
    body = {"messages": messages, "tools": [TOOL], "documents": [DOCUMENT], "tool_choice": "none"}
    with _serve(directory) as url:
        ids = _server_prompt_ids(url, body)
        assert ids == _hf_ids(directory, hf_messages, tools=[TOOL], documents=[DOCUMENT])
        text = "".join(_tokenize(url, {**body, "return_token_strs": True}).json()["token_strs"])
        for part in ('"description": "The weather <now>', "Park:", "[Paris]", "(call_1)"):
            assert part in text, text
        r = _chat(url, {**body, "tool_choice": "auto"})  # no --enable-auto-tool-choice
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_chat_template_kwargs_and_special_tokens_reach_the_template(built, tmp_path):
    template = (
        "{{ bos_token }}{{ eos_token }}{{ unk_token }}{% for m in messages %}{{ m.content }}"
        "{% endfor %}{% if enable_thinking %}<think>{% endif %}{{ strftime_now('%Y')[:0] }}"
    )
    directory = _model(built, tmp_path, "spm", template)
    with _serve(directory) as url:
        body = {"messages": USER_ONLY, "chat_template_kwargs": {"enable_thinking": True}}
        ids = _server_prompt_ids(url, body)
        assert ids == _hf_ids(directory, USER_ONLY, enable_thinking=True)
        assert ids[:3] == [1, 2, 0]  # <s> </s> <unk>, written by the template
        plain = _server_prompt_ids(url, {"messages": USER_ONLY})
        assert plain == _hf_ids(directory, USER_ONLY) != ids
        over = {"messages": USER_ONLY, "chat_template_kwargs": {"bos_token": "</s>"}}
        assert _server_prompt_ids(url, over)[0] == 2  # the kwargs win over the special tokens
        reserved = {"messages": USER_ONLY, "chat_template_kwargs": {"add_generation_prompt": 0}}
        r = _tokenize(url, reserved)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_continue_final_message_and_no_generation_prompt(built, tmp_path, kind):
    directory = _model(built, tmp_path, kind, TEMPLATES["with_bos"])
    open_turn = [*USER_ONLY, {"role": "assistant", "content": "the dog ran "}]
    with _serve(directory) as url:
        body = {"messages": open_turn, "add_generation_prompt": False}
        cont = {**body, "continue_final_message": True}
        assert _server_prompt_ids(url, cont) == _hf_ids(
            directory, open_turn, add_generation_prompt=False, continue_final_message=True
        )
        assert _server_prompt_ids(url, body) == _hf_ids(
            directory, open_turn, add_generation_prompt=False
        )
        r = _chat(url, {"messages": open_turn, "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_the_replica_routers_key_is_the_prompt_a_replica_takes(built, tmp_path):
    """The ingress renders (tools selecting tool_use) and encodes (no second BOS) as the app."""
    named = [{"name": "default", "template": TURNS}, {"name": "tool_use", "template": TOOL_USE}]
    directory = _model(built, tmp_path, "bpe", named)
    keys = RoutingKeys(
        Tenants({}), load_tokenizer(str(directory)), load_chat_template(str(directory))
    )
    body = {"messages": USER_ONLY, "tools": [TOOL]}
    key = keys.key("/v1/chat/completions", None, json.dumps(body).encode())
    assert list(key.tokens) == _hf_ids(directory, USER_ONLY, tools=[TOOL])
    refused = keys.key("/v1/chat/completions", None, b'{"messages": [], "chat_template": "x"}')
    assert refused.tokens == ()


# --- schemathesis: a model whose template refuses ----------------------------------------------
MAX_EXAMPLES = 8
CONFIG = f"""
[generation]
max-examples = {MAX_EXAMPLES}
deterministic = true

[output.sanitization]
enabled = false
"""
# 400s no schema can state: the template's own judgement of a conversation, and the prompt's
# length in tokens (tests/server/test_openapi.py has the same exemptions for the rest).
BEYOND_SCHEMA = (
    "the chat template refused the conversation",
    "the chat template failed on the conversation",
    "continue_final_message: the",
    "the model's context",
    "KV blocks; the pool has only",
    "(a 64-bit seed; seed + n - 1 too)",
)


@pytest.fixture(scope="module")
def refusing_server(built, tmp_path_factory) -> Iterator[str]:
    directory = _model(built, tmp_path_factory.mktemp("refusing"), "spm", MISTRAL)
    with _serve(directory) as url:
        yield url


@pytest.fixture(scope="module")
def refusing_schema(refusing_server):
    config = SchemathesisConfig.from_str(CONFIG)
    return schemathesis.openapi.from_url(f"{refusing_server}/openapi.json", config=config)


# the routes that render the template
schema = schemathesis.pytest.from_fixture("refusing_schema").include(
    path_regex="^/(v1/chat/completions|tokenize)$"
)


@pytest.fixture
def _nodeid_for_schemathesis(request) -> None:
    request.node._nodeid = request.node.nodeid  # as tests/server/test_openapi.py


@pytest.mark.schemathesis
@pytest.mark.usefixtures("_nodeid_for_schemathesis")
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_refusing_template_never_makes_a_5xx(case, refusing_server):
    response = case.call(timeout=120)
    assert response.status_code < 500, response.text
    spared = beyond_schema(case, response, BEYOND_SCHEMA)
    excluded = [positive_data_acceptance] if spared else []
    case.validate_response(response, excluded_checks=excluded)
