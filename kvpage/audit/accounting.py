"""Cache accounting: what a server says it served from cache, against what the audit could have
put there. Every prompt the audit sends is remembered with its namespace (its cache salt, where
salts were found to separate caches; else one namespace for all). A request may legitimately be
served at most the longest common prefix it has with an earlier (or concurrent) prompt of its
namespace — a fresh random prompt under a fresh salt, 0. A `cached_tokens` above that is a
phantom hit: the server's usage is wrong, or it reused KV the request never shared. Alone it is
an accounting anomaly; with an answer that changed, isolation evidence (suites/base.py). Models
are not told apart here: a bound taken across models is only larger, so never a false phantom;
hits across models are the models suite's to judge."""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

TEXT_OVERHEAD = 2  # tokens a text prompt may have beyond one per character (BOS, specials)
# What a text prompt (the capability probes') may share with a random token-id prompt: its BOS
# and one more token. Random letters and random ids agree on a longer prefix only by chance.
TEXT_VS_IDS = 2


@dataclass(frozen=True, slots=True)
class Sent:
    """One prompt as sent: its ids (id prompts), or at most how many tokens it can have (plain
    text: one per character and a BOS), or neither (chat: a template wraps it)."""

    n: int
    salt: str | None
    ids: tuple[int, ...] | None
    max_tokens: int | None


@dataclass(frozen=True, slots=True)
class Anomaly:
    suite: str
    request: int  # the audit's request number (the report's request log)
    prompt: str
    cached_tokens: int
    shared_bound: int  # the most tokens the audit had shared with this prompt in its namespace
    salted: bool

    def sentence(self) -> str:
        where = "under its own fresh cache salt" if self.salted else "in its namespace"
        return (
            f"{self.suite}: request {self.request} ({self.prompt}) was served "
            f"{self.cached_tokens} cached tokens, but at most {self.shared_bound} of its tokens "
            f"had been sent before {where}"
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "sentence": self.sentence()}


@dataclass(slots=True)
class Accounting:
    separate_salts: bool = False  # set once probing showed that salts separate caches
    phase: str = "capabilities"  # the running suite, named in anomalies
    sent: list[Sent] = field(default_factory=list)
    anomalies: list[Anomaly] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, body: dict[str, Any]) -> Sent:
        """Before sending: remember the prompt (concurrent requests see each other)."""
        prompt = body.get("prompt")
        ids = tuple(prompt) if isinstance(prompt, list) else None
        limit = len(prompt) + TEXT_OVERHEAD if isinstance(prompt, str) else None
        with self._lock:
            sent = Sent(len(self.sent) + 1, body.get("cache_salt"), ids, limit)
            self.sent.append(sent)
        return sent

    def bound(self, sent: Sent) -> int | None:
        """The most tokens `sent` can share with the other prompts of its namespace; None when
        unknown (a text prompt after others in its namespace: its tokens are not known)."""
        with self._lock:
            others = [s for s in self.sent if s.n != sent.n and self._same_space(s, sent)]
        if not others:
            return 0
        if sent.ids is None:
            return None
        best = 0
        for other in others:
            if other.ids is not None:
                best = max(best, len(os.path.commonprefix([sent.ids, other.ids])))
            elif other.max_tokens is not None:
                best = max(best, min(other.max_tokens, TEXT_VS_IDS, len(sent.ids)))
            else:
                return None
        return best

    def check(self, sent: Sent, cached: int | None, prompt: str) -> int | None:
        """After the answer: the bound, with an anomaly recorded when `cached` exceeds it."""
        bound = self.bound(sent)
        if cached and bound is not None and cached > bound:
            anomaly = Anomaly(self.phase, sent.n, prompt, cached, bound, sent.salt is not None)
            with self._lock:
                self.anomalies.append(anomaly)
        return bound

    def _same_space(self, a: Sent, b: Sent) -> bool:
        return not self.separate_salts or a.salt == b.salt
