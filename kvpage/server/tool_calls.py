"""Tool calls on chat (vLLM's approach): `tool_choice` "required" or a named function is a JSON
schema constraint on the reply (kvpage.server.structured), and the constrained text becomes the
response's `tool_calls`; "auto" (with `--enable-auto-tool-choice --tool-call-parser hermes`) leaves
the model free and parses the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of
Qwen2.5/Qwen3/Hermes templates out of its text (kvpage.server.hermes); "none" parses nothing.

    required   [{"name": one of the tools, "parameters": its parameters}, ...]  (at least one)
    named      the named function's arguments object

A reply whose calls do not parse (cut by max_tokens) is returned as text, with its finish reason;
calls that parse finish with "tool_calls" where the engine said "stop"."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvpage.server.call_scan import CallScanner, call_id
from kvpage.server.hermes import HermesStream, parse_hermes
from kvpage.server.protocol import ApiError, ChatCompletionRequest
from kvpage.server.structured import Constraint, constraint_from

PARSERS = ("hermes",)  # --tool-call-parser choices
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a tool without parameters (vLLM's)


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of a message's `tool_calls`, OpenAI's shape."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """How a chat request's reply is read: `mode` none (text), named, required or auto."""

    mode: str = "none"
    name: str | None = None  # the named function
    constraint: Constraint | None = None

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole reply as a chat message, and its finish reason."""
        content, calls = self._parsed(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, finish_of(finish_reason, bool(calls))

    def _parsed(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if self.mode == "auto":
            return parse_hermes(text)
        try:
            value = json.loads(text)  # named: the arguments; required: the array of calls
        except ValueError:
            return text, []  # cut short (max_tokens): the text as it is
        if self.mode == "named":
            return None, [tool_call(self.name, text)]
        try:
            return None, [tool_call(c["name"], _arguments(c["parameters"])) for c in value]
        except (TypeError, KeyError):  # not the schema's array: the text as it is
            return text, []

    def stream(self) -> ToolStream:
        return ToolStream(self)


def finish_of(finish_reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _arguments(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass(slots=True)
class ToolStream:
    """One choice's streamed reply as OpenAI streams tool calls: per call a first delta with
    index, id, type, function.name and arguments "", then argument fragments (coalesced per
    chunk). Named: the text is the arguments. Required: each element of the array read as it is
    written (kvpage.server.call_scan). Auto: content until a `<tool_call>` starts, then its call
    (kvpage.server.hermes)."""

    policy: ToolPolicy
    text: str = ""  # required: the array so far
    at: int = 0  # required: where the element being written starts (or the next one is looked for)
    element: CallScanner | None = None  # required: the element being written
    calls: int = 0
    hermes: HermesStream = field(default_factory=HermesStream)

    @property
    def called(self) -> bool:
        return self.calls > 0 or self.hermes.calls > 0

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """The chunk's delta for this much more text ({} when it has nothing to say yet)."""
        if self.policy.mode == "auto":
            content, entries = self.hermes.feed(text, final)
        else:
            content, entries = "", self._constrained(text)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if entries:
            delta["tool_calls"] = coalesce(entries)
        return delta

    def _constrained(self, text: str) -> list[dict[str, Any]]:
        if self.policy.mode == "named":
            if not text and self.calls:
                return []
            entries = [] if self.calls else [_header(0, self.policy.name)]
            self.calls = 1
            return [*entries, {"index": 0, "function": {"arguments": text}}] if text else entries
        self.text += text
        entries: list[dict[str, Any]] = []
        while True:
            if self.element is None:
                start = _element_start(self.text, self.at)
                if start is None:
                    return entries
                self.at, self.element = start, CallScanner("parameters")
            entries += self.element.progress(self.text[self.at :], self.calls)
            end = self._element_end()
            if end is None:
                return entries
            if not self.element.header_sent:  # its keys in another order: sent whole
                entries.append(self._whole_element(end))
            self.at, self.element = end, None
            self.calls += 1

    def _element_end(self) -> int | None:
        """Where the element being written ends (past its `}`), None while it is not whole."""
        if self.element.header_sent:
            if not self.element.done:
                return None
            close = self.text.find("}", self.at + self.element.arguments_end)
            return None if close < 0 else close + 1
        try:
            _, end = json.JSONDecoder().raw_decode(self.text, self.at)
        except ValueError:
            return None
        return end

    def _whole_element(self, end: int) -> dict[str, Any]:
        value = json.loads(self.text[self.at : end])
        header = _header(self.calls, value.get("name", ""))
        header["function"]["arguments"] = _arguments(value.get("parameters", {}))
        return header


def _element_start(text: str, at: int) -> int | None:
    """Where the array's next element begins, past `[` or `,` and whitespace (None: not yet)."""
    i = at
    while i < len(text) and text[i] in " \t\r\n[,":
        i += 1
    return i if i < len(text) and text[i] == "{" else None


def _header(index: int, name: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id(),
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }


def coalesce(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive entries of one call merged (its header and fragments in one chunk)."""
    out: list[dict[str, Any]] = []
    for entry in entries:
        if out and out[-1]["index"] == entry["index"]:
            last = out[-1]
            last["function"] = dict(last.get("function", {}))
            arguments = last["function"].get("arguments", "") + entry["function"]["arguments"]
            last["function"]["arguments"] = arguments
        else:
            out.append({**entry, "function": dict(entry["function"])})
    return out


# --- the request side ----------------------------------------------------------------------
def tool_policy(body: ChatCompletionRequest, auto_parser: str | None) -> ToolPolicy:
    """What the request's tool_choice asks for (vLLM's rules). `auto_parser`: the server's
    --tool-call-parser when --enable-auto-tool-choice is set, else None."""
    choice, tools = body.tool_choice, body.tools
    if choice is None:  # vLLM's default: auto with tools (where the server parses), else none
        return ToolPolicy("auto") if tools and auto_parser else ToolPolicy()
    if choice == "none":
        return ToolPolicy()
    if tools is None:
        raise ApiError(
            "tool_choice needs tools: when using tool_choice, tools must be set", "tools"
        )
    if choice == "auto":
        if auto_parser is None:
            raise ApiError(
                'tool_choice "auto" requires the server to run with --enable-auto-tool-choice '
                "and --tool-call-parser",
                "tool_choice",
            )
        return ToolPolicy("auto")
    if choice == "required":
        if not tools:  # OpenAI's and vLLM's: required of no tools is none
            return ToolPolicy()
        schema = required_schema(function_tools(tools))
        return ToolPolicy(
            "required", None, constraint_from("tool_choice", "tool_choice", json=schema)
        )
    name = choice.function.name
    functions = function_tools(tools)
    if name not in functions:
        known = ", ".join(sorted(functions)) or "none"
        raise ApiError(
            f"tool_choice names function {name!r}, which does not match any of the tools ({known})",
            "tool_choice",
        )
    where = f"tools.{list(functions).index(name)}.function.parameters"
    constraint = constraint_from("tool_choice", where, json=functions[name] or EMPTY_PARAMETERS)
    return ToolPolicy("named", name, constraint)


def function_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """name -> parameters schema of each tool; a tool not in OpenAI's function shape is a 400."""
    out: dict[str, dict[str, Any] | None] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise ApiError(
                f'tools.{i}: a tool is {{"type": "function", "function": {{"name": ..., '
                f'"parameters": {{...}}}}}}',
                "tools",
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ApiError(f"tools.{i}.function.parameters must be a JSON schema object", "tools")
        out[name] = parameters
    return out


def required_schema(functions: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of at least one call, each the name
    of a tool and that tool's parameters; the tools' `$defs` gathered at the root (where their
    `#/$defs/...` references then point)."""
    defs: dict[str, Any] = {}
    alternatives = []
    for name, parameters in functions.items():
        parameters = dict(parameters or EMPTY_PARAMETERS)
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise ApiError(f"tools: two tools define $defs.{key} differently", "tools")
        alternatives.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if defs:
        schema["$defs"] = defs
    return schema
