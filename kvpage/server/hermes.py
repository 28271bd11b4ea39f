"""The hermes tool-call format (Qwen2.5, Qwen3 and Hermes chat templates): the model writes each
call as `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` among its text.

`parse_hermes(text)`: the whole reply -> (content, calls), vLLM's way: a block that is not a JSON
object with a name stays in the content; content is None when nothing else is left.

`HermesStream`: the same, as text arrives in pieces. Content streams until a `<tool_call>` starts
(a tail that may be the start of one is held back); inside a block, the call's first delta goes
out once its name is whole (index, id, type, function.name, arguments ""), then the arguments
object's text in fragments as it is written. A block that never names its function first is sent
whole when it closes; one that is no call at all goes out as content."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvpage.server.call_scan import CallScanner, call_id

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


def _call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block's text, None if it is not a call."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls, content, at = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        content.append(text[at : match.start()])
        at = match.end()
        name, arguments = call
        calls.append(
            {
                "id": call_id(),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    if not calls:
        return text, []
    content.append(text[at:])
    joined = "".join(content)
    return (joined if joined.strip() else None), calls


@dataclass(slots=True)
class HermesStream:
    pending: str = ""  # text not yet sent: a held-back tail, or the open block's text
    in_block: bool = False
    calls: int = 0  # calls sent (the next one's index)
    call: CallScanner = field(default_factory=lambda: CallScanner("arguments"))

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool-call delta entries) that `text` adds; `final`: the reply ends here."""
        self.pending += text
        content, entries = [], []
        while True:
            if not self.in_block:
                start = self.pending.find(START)
                if start < 0:
                    keep = 0 if final else _held(self.pending)
                    content.append(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                content.append(self.pending[:start])
                self.pending = self.pending[start + len(START) :]
                self._open()
                continue
            end = self.pending.find(END)
            block = self.pending if end < 0 else self.pending[:end]
            entries += self._progress(block)
            if end < 0:
                if final:  # an unclosed block: a call if it began as one, else text
                    content.append("" if self.call.header_sent else START + self.pending)
                    self.calls += self.call.header_sent
                    self.pending, self.in_block = "", False
                break
            closed, text_back = self._close(block)
            entries += closed
            content.append(text_back)
            self.pending = self.pending[end + len(END) :]
        return "".join(content), entries

    def _open(self) -> None:
        self.in_block, self.call = True, CallScanner("arguments")

    def _progress(self, block: str) -> list[dict[str, Any]]:
        return self.call.progress(block, self.calls)

    def _close(self, block: str) -> tuple[list[dict[str, Any]], str]:
        """A block's end: (entries still to send, text it gives back as content)."""
        self.in_block = False
        if self.call.header_sent:  # sent as it came
            self.calls += 1
            return [], ""
        call = _call(block)
        if call is None:
            return [], START + block + END
        name, arguments = call
        entry = {"index": self.calls, "id": call_id(), "type": "function"}
        entry["function"] = {"name": name, "arguments": arguments}
        self.calls += 1
        return [entry], ""


def _held(text: str) -> int:
    """The length of `text`'s longest tail that a `<tool_call>` could begin with."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
