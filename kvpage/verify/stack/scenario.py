"""Seeded, reproducible request sequences for the server suite: one per app (an app with API keys
and tenants, an open app whose clients pick cache salts), interleaved with admin switches and
requests the server must refuse.

Prompts are cut from a few shared documents at block boundaries ±1 (so prefix hits of every
size happen within a tenant, and the same tokens are sent by other tenants), with multi-byte
characters in them; no prompt is a strict prefix of another, so a hit never reaches into a
sample's generated tokens (whose cached length depends on when an abort lands). Stop strings are
picked later from the reference's own text (`pick_stops`), so they do occur, across tokens and
across multi-byte characters, or nearly occur (a prefix of one, held back, then released)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace

ALPHABET = "abcdefgh ijklm nopqrstuvwxyz,.\n" + "éü€ß中😀"
TENANTS = ("alice", "bob", "carol")
SALTS = (None, "s1", "s2")


@dataclass(frozen=True, slots=True)
class GenRequest:
    name: str
    chat: bool
    prompt: str | tuple[int, ...]  # completions: text or token ids; chat: the user message
    tenant: str | None  # whose API key (apps with keys)
    cache_salt: str | None  # open app only
    n: int
    temperature: float
    seed: int | None
    max_tokens: int
    logprobs: int | None
    stop_picks: int  # how many stop strings to take from the reference's text
    stop_token_at: int | None  # stop_token_ids: the reference's own token at this step
    stream: bool
    include_usage: bool
    return_token_ids: bool
    echo: bool = False  # completions: the prompt (and its logprobs) before each choice
    more_prompts: tuple = ()  # completions: a list of prompts, `prompt` first, then these

    @property
    def prompts(self) -> tuple:
        return (self.prompt, *self.more_prompts)


@dataclass(frozen=True, slots=True)
class AdminEvent:
    """`kind`: prefix-caching | preemption | drain | bad-key | salt-with-key."""

    kind: str
    enabled: bool = True
    tenant: str | None = None
    cache_salt: str | None = None
    namespace: bool = False


@dataclass(frozen=True, slots=True)
class Scenario:
    with_keys: bool
    block_size: int
    chat_allowed: bool
    events: list[GenRequest | AdminEvent] = field(default_factory=list)

    @property
    def requests(self) -> list[GenRequest]:
        return [e for e in self.events if isinstance(e, GenRequest)]


def make_scenario(
    rng: random.Random,
    tokenizer,
    with_keys: bool,
    size: int,
    chat_allowed: bool,
    batches: bool = True,
) -> Scenario:
    """`tokenizer`: the oracle's (kvpage.verify.stack.text_oracle), to cut prompts on token
    boundaries. `batches`: lists of prompts in one request (off where ties are followed: the
    engine's draws are followed for one request at a time)."""
    block_size = rng.choice((4, 8, 16))
    plan = _Plan(rng, with_keys, [_text(rng, rng.randint(40, 70)) for _ in range(3)])
    scoped_at = rng.randint(size // 3, 2 * size // 3)  # one scoped switch-off at least
    events: list[GenRequest | AdminEvent] = []
    prompts: list[tuple[int, ...]] = []
    for i in range(size):
        events += plan.switches(i, i == scoped_at)
        doc, who = plan.next_sender()
        req = _request(rng, f"r{i}", doc, who, block_size, chat_allowed, tokenizer, prompts)
        events.append(_extend(rng, req, plan.docs, block_size, tokenizer, prompts, batches))
    events.extend(_closing(with_keys))
    return Scenario(with_keys, block_size, chat_allowed, events)


@dataclass(slots=True)
class _Plan:
    """Which switches flip before each request, and who sends it on which document."""

    rng: random.Random
    with_keys: bool
    docs: list[str]
    focus: list[AdminEvent] = field(default_factory=list)  # a namespace switched off
    restores: list[tuple[int, AdminEvent]] = field(default_factory=list)  # (request, back on)
    last_doc: dict[tuple[str | None, str | None], str] = field(default_factory=dict)

    def switches(self, i: int, scoped: bool) -> list[AdminEvent]:
        rng = self.rng
        due = [e for at, e in self.restores if at == i]
        if any(_scoped(e) for e in due):
            self.focus = []
        admin = _admin(rng, self.with_keys) if i and rng.random() < 0.3 else []
        if scoped:
            admin.append(_scoped_off(rng, self.with_keys, self.last_doc))
        off = [e for e in admin if e.kind in ("prefix-caching", "preemption") and not e.enabled]
        self.restores += [(i + rng.randint(2, 5), dc_replace(e, enabled=True)) for e in off]
        self.focus = [e for e in off if _scoped(e)] or self.focus
        return due + admin

    def next_sender(self) -> tuple[str, tuple[str | None, str | None]]:
        """While a namespace is switched off, its next turns mostly, on the document it was
        reading (so they would hit); otherwise anyone on any document."""
        rng = self.rng
        who = (rng.choice(TENANTS), None) if self.with_keys else (None, rng.choice(SALTS))
        doc = rng.choice(self.docs)
        if self.focus and rng.random() < 0.7:
            who = (self.focus[0].tenant, self.focus[0].cache_salt)
            doc = self.last_doc.get(who, doc)
        self.last_doc[who] = doc
        return doc, who


def _scoped_off(rng: random.Random, with_keys: bool, seen: dict) -> AdminEvent:
    """Caching off for a namespace that has sent requests already (a tenant's, or a client
    salt's: not the unsalted one, which a switch aimed at the wrong namespace would hit)."""
    sent = sorted((t or "", s or "") for t, s in seen if (t or s))
    if with_keys:
        tenant = rng.choice(sent)[0] if sent else rng.choice(TENANTS)
        return AdminEvent("prefix-caching", False, tenant=tenant)
    salt = rng.choice(sent)[1] if sent else "s1"
    return AdminEvent("prefix-caching", False, cache_salt=salt)


def _scoped(event: AdminEvent) -> bool:
    return event.kind == "prefix-caching" and (
        event.tenant is not None or event.cache_salt is not None or event.namespace
    )


def _text(rng: random.Random, chars: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(chars))


def _request(rng, name, doc, who, block_size, chat_allowed, tokenizer, prompts):
    chat = chat_allowed and rng.random() < 0.2
    as_ids = not chat and rng.random() < 0.6
    for _ in range(20):  # until it is no strict prefix of an earlier prompt, nor one of it
        prompt = _prompt(rng, doc, block_size, tokenizer, as_ids)
        ids = tuple(prompt) if as_ids else tuple(tokenizer.encode(prompt))
        if not any(_strict_prefix(ids, p) or _strict_prefix(p, ids) for p in prompts):
            break
    prompts.append(ids)
    n = rng.choice((1, 1, 1, 2, 3))
    temperature = rng.choice((0.0, 0.0, 0.8, 1.0))
    return GenRequest(
        name=name,
        chat=chat,
        prompt=prompt,
        tenant=who[0],
        cache_salt=who[1],
        n=n,
        temperature=temperature,
        seed=rng.randint(0, 10_000) if temperature or rng.random() < 0.3 else None,
        max_tokens=rng.randint(4, 32),
        logprobs=rng.choice((None, None, 0, 1, 3)),
        stop_picks=rng.choice((0, 1, 1, 2, 3)),
        stop_token_at=rng.randint(1, 6) if rng.random() < 0.15 else None,
        stream=rng.random() < 0.5,
        include_usage=rng.random() < 0.7,
        return_token_ids=rng.random() < 0.7,
    )


def _extend(rng, req: GenRequest, docs, block_size, tokenizer, prompts, batches) -> GenRequest:
    """Completions only: now and then echo (with max_tokens 0 at times: the prompt scored
    alone), or a list of prompts (each on another document, so no two share a whole block:
    which of them the engine runs first, and so which would hit the other, is its choice)."""
    if req.chat:
        return req
    roll = rng.random()
    if roll < 0.25:
        max_tokens = 0 if rng.random() < 0.35 else req.max_tokens
        req = dc_replace(req, echo=True, max_tokens=max_tokens, stop_token_at=None)
        if req.logprobs is None:
            return req
        # Prompt logprobs hit only blocks whose rows the engine kept, and what it publishes
        # then is its own business: a prompt of its own, sharing no block with any other.
        prompts.pop()
        for _ in range(20):
            text = _text(rng, rng.randint(block_size, 40))
            ids = _ids(tokenizer, text)
            if not any(common_prefix(ids, p) >= min(block_size, len(ids) - 1) for p in prompts):
                break
        prompts.append(ids)
        return dc_replace(req, prompt=text if isinstance(req.prompt, str) else ids)
    if roll > 0.82 and batches:
        first = _ids(tokenizer, req.prompt)
        more = []
        for doc in rng.sample(docs, rng.randint(1, 2)):
            prompt = _prompt(rng, doc, block_size, tokenizer, isinstance(req.prompt, tuple))
            ids = _ids(tokenizer, prompt)
            taken = [first, *(_ids(tokenizer, p) for p in more)]
            if any(common_prefix(ids, p) >= block_size for p in taken) or any(
                _strict_prefix(ids, p) or _strict_prefix(p, ids) for p in prompts
            ):
                continue
            more.append(prompt)
            prompts.append(ids)
        return dc_replace(req, more_prompts=tuple(more))
    return req


def _ids(tokenizer, prompt) -> tuple[int, ...]:
    return tuple(prompt) if isinstance(prompt, tuple) else tuple(tokenizer.encode(prompt))


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens a and b share."""
    return len(os.path.commonprefix([a, b]))


def _prompt(rng, doc: str, block_size: int, tokenizer, as_ids: bool) -> str | tuple[int, ...]:
    """A document's head cut near a block boundary, then a few characters of its own."""
    suffix = _text(rng, rng.randint(1, 6))
    if as_ids:
        ids = tokenizer.encode(doc)
        cut = max(1, rng.randint(1, len(ids) // block_size) * block_size + rng.choice((-1, 0, 1)))
        return tuple(ids[:cut]) + tuple(_encode_bare(tokenizer, suffix))
    cut = rng.randint(block_size - 1, len(doc))
    return doc[:cut] + suffix


def _encode_bare(tokenizer, text: str) -> list[int]:
    """`text`'s ids without the special tokens an encoder may put in front."""
    return list(tokenizer.encode(text, bos=False))


def _strict_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) < len(b) and b[: len(a)] == a


def _admin(rng: random.Random, with_keys: bool) -> list[AdminEvent]:
    """A switch turned off (back on a few requests later, and at the end by `_closing`) or on,
    a drain and its end, or a request the server must refuse."""
    kind = rng.choice(
        ("prefix-caching", "namespace", "namespace", "preemption", "drain", "refused")
    )
    on = rng.random() < 0.15  # mostly off: on is the default, and it comes back later
    if kind == "prefix-caching":
        return [AdminEvent("prefix-caching", enabled=on)]
    if kind == "namespace":
        if with_keys:
            return [AdminEvent("prefix-caching", on, tenant=rng.choice(TENANTS))]
        salt = rng.choice((*SALTS, "s1", "s2"))
        return [AdminEvent("prefix-caching", on, cache_salt=salt, namespace=salt is None)]
    if kind == "preemption":
        return [AdminEvent("preemption", enabled=on)]
    if kind == "drain":
        return [AdminEvent("drain", True), AdminEvent("drain", False)]
    if with_keys:
        return [AdminEvent(rng.choice(("bad-key", "salt-with-key")), tenant=rng.choice(TENANTS))]
    return [AdminEvent("drain", True), AdminEvent("drain", False)]


def _closing(with_keys: bool) -> list[AdminEvent]:
    """Every switch back on: the app ends as it started."""
    events = [AdminEvent("prefix-caching", True), AdminEvent("preemption", True)]
    if with_keys:
        return events + [AdminEvent("prefix-caching", True, tenant=t) for t in TENANTS]
    return events + [
        AdminEvent("prefix-caching", True, cache_salt=s, namespace=s is None) for s in SALTS
    ]


def pick_stops(rng: random.Random, text: str, count: int) -> list[str]:
    """Stop strings from the reference's text: substrings that occur (favouring ones with a
    multi-byte character), near misses (a real prefix, then a character that does not follow
    it there), and now and then one that never occurs."""
    clean = [i for i, ch in enumerate(text) if ch != "\ufffd"]
    stops: list[str] = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.1 or not clean:
            stops.append("\u2603" + _text(rng, 2))
            continue
        wide = [i for i in clean if ord(text[i]) > 127]
        start = rng.choice(wide) if wide and rng.random() < 0.5 else rng.choice(clean)
        start = max(0, start - rng.randint(0, 2))
        piece = text[start : start + rng.randint(1, 4)].split("\ufffd")[0]
        if not piece:
            continue
        if roll < 0.3:
            piece = piece[:-1] + "\u2603"  # nearly occurs: held back, then released
        stops.append(piece)
    return stops
