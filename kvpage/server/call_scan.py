"""A tool call's JSON object read as it is written (`{"name": "f", "arguments": {...}}`), so that a
stream can send it as OpenAI does: once the name is whole, the call's first delta (index, id,
type, function.name, arguments ""), then the arguments value's text in fragments as it arrives,
up to where that value ends. Used by the hermes parser ("arguments") and by tool_choice
"required" ("parameters", vLLM's key)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ValueScan:
    """Where a JSON value written in pieces ends: strings, escapes and nesting tracked."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False
    scalar: bool = False
    done: bool = False

    def take(self, text: str) -> int:
        """How many characters of `text` belong to the value (stops at its end)."""
        for i, ch in enumerate(text):
            if not self._step(ch):
                self.done = True
                return i
            if self.done:
                return i + 1
        return len(text)

    def _step(self, ch: str) -> bool:
        """False: `ch` is past the value (a scalar's delimiter)."""
        if not self.started:
            self.started = True
            self.scalar = ch not in '{["'
        if self.scalar:
            return ch not in ",}] \t\r\n"
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self.done = self.depth == 0
            return True
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


def _head(key: str) -> re.Pattern:
    """An object that names its function before its arguments: the header can go first."""
    return re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"' + key + r'"\s*:\s*')


@dataclass(slots=True)
class CallScanner:
    key: str  # the arguments' key: "arguments" (hermes) or "parameters" (required)
    header_sent: bool = False
    arguments_at: int = 0  # where the arguments value starts in the object's text
    sent: int = 0  # the arguments' characters sent so far
    scan: ValueScan = field(default_factory=ValueScan)

    @property
    def done(self) -> bool:
        """The arguments value is whole."""
        return self.scan.done

    @property
    def arguments_end(self) -> int:
        return self.arguments_at + self.sent

    def progress(self, text: str, index: int) -> list[dict[str, Any]]:
        """The delta entries of call `index` that `text` (the object so far) adds."""
        entries = []
        if not self.header_sent:
            head = _head(self.key).match(text)
            if head is None:
                return []
            self.header_sent, self.arguments_at = True, head.end()
            entry = {"index": index, "id": call_id(), "type": "function"}
            entry["function"] = {"name": json.loads(head.group(1)), "arguments": ""}
            entries.append(entry)
        if not self.scan.started:  # whitespace before the arguments is no part of them
            rest = text[self.arguments_at :]
            self.arguments_at += len(rest) - len(rest.lstrip())
        if not self.scan.done:
            new = text[self.arguments_end :]
            taken = self.scan.take(new)
            if taken:
                self.sent += taken
                entries.append({"index": index, "function": {"arguments": new[:taken]}})
        return entries
