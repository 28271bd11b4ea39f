"""Incremental detokenization with stop strings.

The engine decodes text only when a request finishes; a stream needs it token by token. Decoding
the whole output each time and emitting what is new handles tokens that are only part of a
character (an incomplete UTF-8 sequence decodes to U+FFFD and is held back until it completes).
Text that could still grow into a stop string is held back too, so a stop string is never sent."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.model.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


@dataclass(slots=True)
class TextStream:
    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    sent: str = ""  # text already handed out
    stopped: bool = False  # a stop string matched; the text ends before it

    def add(self, new_ids: list[int], final: bool) -> str:
        """Append tokens; return the text that may be sent now (all of it when `final`)."""
        self.token_ids.extend(new_ids)
        text = self.tokenizer.decode(self.token_ids)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if final:
            return self._emit(text)
        end = len(text) - self._partial_stop(text)
        while end > len(self.sent) and text[end - 1] == _INCOMPLETE:
            end -= 1
        return self._emit(text[:end])

    def _stop_at(self, text: str) -> int | None:
        # A match can only end in text not yet checked; start early enough to see one straddle.
        start = max(0, len(self.sent) - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that a stop string starts with."""
        longest = max((len(s) for s in self.stop), default=1)
        for n in range(min(len(text), longest - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop):
                return n
        return 0

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.sent):
            return ""
        piece = text[len(self.sent) :]
        self.sent = text
        return piece

    @property
    def text(self) -> str:
        return self.sent
