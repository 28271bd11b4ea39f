"""Chat messages -> one prompt string, as transformers 5.24's `apply_chat_template` renders it.

Where the template comes from (`load_chat_template`), first found wins:

1. the server's `--chat-template FILE|STRING` (vLLM's semantics: a path when that file exists,
   else the template's own text, its backslash escapes decoded): it replaces the model's templates;
2. the model directory's `chat_template.jinja` (the "default" template) and
   `additional_chat_templates/NAME.jinja` (named ones): where they exist, transformers ignores
   tokenizer_config.json's templates;
3. tokenizer_config.json's `chat_template`: a string, or a list of `{name, template}`;
4. else (the built-in models, a directory without a template) the documented built-in one:

    <|system|>\\nYou are terse.\\n<|user|>\\nHi\\n<|assistant|>\\n

   one `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` for the reply to follow.

Of several named templates (transformers' `get_chat_template`): the one a request names in
`chat_template`, else "tool_use" when the request has `tools`, else "default". A request's
`chat_template` must be such a name: a template's own text per request is refused (vLLM refuses it
too unless started with --trust-request-chat-template: it runs the client's code on the server).

The Jinja environment is transformers': sandboxed (immutable), trim_blocks and lstrip_blocks, the
loopcontrols extension and `{% generation %}` blocks, `tojson` without HTML escaping,
`raise_exception(message)` and `strftime_now(format)`, and its guarded `dict` and `namespace`. A
render sees `messages` (keys whose value is null left out; a tool call's JSON `arguments` as a
dict, as vLLM hands them over), `tools`, `documents`,
`add_generation_prompt`, the tokenizer's named special tokens as strings (bos_token, eos_token,
unk_token, pad_token, ...: tokenizer_config.json, then special_tokens_map.json over it), and the
request's `chat_template_kwargs` over those (vLLM merges them the same way; they may not set
the render's own arguments, which are request fields: protocol.RENDER_ARGUMENTS).
`continue_final_message`
renders the last message open, transformers' way (a tag after its content, the text cut there).

A template that refuses a conversation (`raise_exception`, an undefined name it dereferences, any
error while it renders) is the client's 400, param `messages`; a template that does not compile
fails at start-up (`ChatTemplateInvalid`). A model's own template spells its special tokens: its
text is encoded without adding any (as transformers does); the built-in template's is encoded with
them."""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from kvpage.errors import ModelLoadError
from kvpage.server.protocol import ApiError, ChatCompletionRequest, TokenizeRequest

Messages = list[dict[str, Any]]

SIMPLE_SOURCE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of the message left open
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token")
_SPECIAL_NAMES += ("cls_token", "mask_token")


class ChatTemplateInvalid(ModelLoadError):
    """A chat template that does not compile (or cannot be read): the server does not start."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """What a request asks the template to render (the request's fields, as transformers names
    them)."""

    messages: Messages
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_name: str | None = None  # the request's `chat_template`: one of the model's names
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs

    @classmethod
    def of(cls, body: ChatCompletionRequest | TokenizeRequest) -> Conversation:
        return cls(
            messages=[m.template_dict() for m in body.messages or ()],
            tools=body.tools,
            documents=body.documents,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_name=body.chat_template,
            kwargs=body.chat_template_kwargs or {},
        )


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A model's chat templates by name ("default" for a single one), compiled, and the special
    tokens a render gets. Called with messages alone it renders them as a chat completion does
    by default (the replica router's key)."""

    sources: dict[str, str]
    specials: dict[str, str]
    origin: str  # where the templates were read: the start-up banner, errors
    builtin: bool = False  # the documented template: its text is encoded with special tokens
    compiled: dict[str, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        compiled = {
            name: _compile(source, self.origin, name) for name, source in self.sources.items()
        }
        object.__setattr__(self, "compiled", compiled)

    def describe(self) -> str:
        """For the start-up banner: where the templates came from, and their names if several."""
        if list(self.compiled) == ["default"]:
            return self.origin
        return f"{self.origin} ({', '.join(sorted(self.compiled))})"

    def __call__(self, messages: Messages) -> str:
        return self.render(Conversation(messages))

    def render(self, conv: Conversation) -> str:
        name = self.select(conv.template_name, conv.tools)
        if conv.continue_final_message:
            return self._render_open(name, conv)
        return self._render(name, conv, conv.messages)

    def select(self, name: str | None, tools: list | None) -> str:
        """transformers' get_chat_template: the name asked for, "tool_use" with tools, else
        "default"."""
        if name is not None:
            if name in self.compiled:
                return name
            raise ApiError(
                f"chat_template: the model has no template named {name!r} ({self._names()}); a "
                "template's own text is not accepted per request",
                "chat_template",
            )
        if tools is not None and "tool_use" in self.compiled:
            return "tool_use"
        if "default" in self.compiled:
            return "default"
        raise ApiError(
            f"the model has several chat templates and none named default: name one in "
            f"chat_template ({self._names()})",
            "chat_template",
        )

    def _names(self) -> str:
        return "it has " + ", ".join(sorted(self.compiled))

    def _render(self, name: str, conv: Conversation, messages: Messages) -> str:
        try:
            return self.compiled[name].render(
                messages=messages,
                tools=conv.tools,
                documents=conv.documents,
                add_generation_prompt=conv.add_generation_prompt,
                **{**self.specials, **conv.kwargs},  # the kwargs win, as in transformers
            )
        except Exception as err:  # the template's own code failed on this conversation
            raise _refusal(err) from err

    def _render_open(self, name: str, conv: Conversation) -> str:
        """transformers' continue_final_message: the last message's content tagged, the chat
        rendered, and cut where the tag begins (its trailing space too, if the template kept it)."""
        if conv.add_generation_prompt:
            raise ApiError(
                "continue_final_message needs add_generation_prompt false", "continue_final_message"
            )
        final = conv.messages[-1].get("content")
        if not isinstance(final, str):
            raise ApiError(
                "continue_final_message: the final message has no content to continue", "messages"
            )
        if "content" not in self.sources[name]:  # transformers' test: it names no content
            raise ApiError(
                "continue_final_message: the chat template writes no message content",
                "continue_final_message",
            )
        messages = [*conv.messages[:-1], {**conv.messages[-1], "content": final + _CONTINUE_TAG}]
        text = self._render(name, conv, messages)
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            message = "continue_final_message: the chat template drops part of the final message"
            raise ApiError(message, "messages")
        at = text.rindex(tag)
        return (
            text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        )


def _refusal(err: Exception) -> ApiError:
    import jinja2

    if isinstance(err, jinja2.TemplateError):
        return ApiError(
            f"the chat template refused the conversation: {err.message or err}", "messages"
        )
    return ApiError(
        f"the chat template failed on the conversation: {type(err).__name__}: {err}", "messages"
    )


def load_chat_template(model: str, override: str | None = None) -> ChatTemplate:
    """`model`'s chat templates (its directory's, as transformers loads them), or `override`'s
    text in their place; the built-in template when neither has one. Raises ChatTemplateInvalid
    if a template does not compile."""
    directory = Path(model)
    specials = special_tokens(directory)
    if override is not None:
        return ChatTemplate({"default": override}, specials, "--chat-template")
    sources, origin = model_templates(directory)
    if not sources:
        return simple_template
    return ChatTemplate(sources, specials, f"{model}'s {origin}")


def model_templates(directory: Path) -> tuple[dict[str, str], str]:
    """The directory's templates by name, and which file they came from (none: `{}`)."""
    files = {}
    if (directory / "chat_template.jinja").is_file():
        files["default"] = _read(directory / "chat_template.jinja")
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = _read(path)
    if files:
        return files, "chat_template.jinja / additional_chat_templates/"
    source = _config(directory / "tokenizer_config.json").get("chat_template")
    if isinstance(source, str):
        return {"default": source}, "tokenizer_config.json"
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
            raise ChatTemplateInvalid(
                "tokenizer_config.json: chat_template entries need a string name and template"
            )
        return named, "tokenizer_config.json"
    return {}, ""


def template_text(value: str) -> str:
    """--chat-template's value as vLLM reads it: a file's text where that file exists; else, if
    it has no Jinja character, a path that cannot be opened (an error); else the template itself,
    backslash escapes decoded (`\\n` typed on a command line is a newline)."""
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError, UnicodeDecodeError) as err:
        if not any(ch in value for ch in "{}\n"):
            raise ChatTemplateInvalid(
                f"--chat-template {value}: looks like a file path, but cannot be read ({err})"
            ) from None
    return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")


def special_tokens(directory: Path) -> dict[str, str]:
    """The tokenizer's named special tokens as strings, as transformers' `special_tokens_map`
    hands them to a template: the standard names, any other `*_token` string, and a dict of
    `extra_special_tokens`; special_tokens_map.json over tokenizer_config.json."""
    config = _config(directory / "tokenizer_config.json")
    legacy = _config(directory / "special_tokens_map.json")
    extra = config.get("extra_special_tokens")
    merged = {**config, **(extra if isinstance(extra, dict) else {}), **legacy}
    out = {}
    for name, value in merged.items():
        text = _token_text(value)
        if text is not None and (name in _SPECIAL_NAMES or name.endswith("_token")):
            out[name] = text
    return out


def _token_text(token: object) -> str | None:
    """A token as a string: `"<s>"`, or an AddedToken's dict `{"content": "<s>", ...}`."""
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return token if isinstance(token, str) else None


def _config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ChatTemplateInvalid(f"{path}: cannot read it ({err})") from None
    return config if isinstance(config, dict) else {}


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ChatTemplateInvalid(f"{path}: cannot read it ({err})") from None


def _compile(source: str, origin: str, name: str) -> Any:
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as err:
        which = "" if name == "default" else f" {name!r}"
        raise ChatTemplateInvalid(
            f"the chat template{which} from {origin} does not compile: {err.message} (line {err.lineno})"
        ) from None


@cache
def _environment() -> Any:
    """transformers' chat-template environment (utils/chat_template_utils.py), built once."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_extension(), jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' own: Jinja's escapes HTML characters, which a prompt must keep as they are
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    """transformers' `dict` global: builds dicts, exposes nothing else of the type."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _namespace_class() -> type:
    """transformers' `namespace`: no underscore-prefixed attributes (the way to CPython's
    internals)."""
    import jinja2
    import jinja2.utils

    def check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                f"got {name!r}. Please rename the attribute."
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # Jinja's signature trick: `namespace(self=...)` works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _generation_extension() -> type:
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens with
    it): rendered as its body; templates that use it must compile."""
    import jinja2.nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    return Generation


# The documented template of models without one (after the environment it compiles in)
simple_template = ChatTemplate(
    {"default": SIMPLE_SOURCE}, {}, "the built-in template", builtin=True
)
