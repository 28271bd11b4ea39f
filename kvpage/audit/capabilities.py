"""What the server offers, found by asking it (about a dozen small requests) before any suite
runs. Every later request is built from these findings, and every "no" is reported with the
reason, so an audit of a server we know nothing about says what it could not test."""

from __future__ import annotations

import random
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpage.audit.client import AuditClient
from kvpage.audit.completion import IDS_FIELD, parse_body
from kvpage.audit.config import AuditConfig
from kvpage.audit.errors import AuthFailed, RequestRejected, ServerIncompatible
from kvpage.audit.probes import PromptFactory

# Token-id ranges tried for id prompts: most vocabularies are large; byte-level ones are not.
ID_RANGES = ((1000, 30000), (3, 250))
TOP_K = 5


@dataclass(slots=True)
class Capabilities:
    endpoint: str = "completions"  # or "chat"
    text_prompts: bool = False
    id_range: tuple[int, int] | None = None  # token-id prompts accepted, drawn from this range
    logprobs: bool = False  # top-k logprobs per output token
    seed: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False  # the server honours vLLM's `return_token_ids`
    tokens_as_ids: bool = False  # ... and `return_tokens_as_token_ids` (unique top-k keys)
    logprobs_field: str | None = None  # where its logprobs are (completion.py's shapes)
    token_ids_field: str | None = None  # where its output token ids are (None: not given)
    cache_salt: bool = False  # a per-request cache namespace (vLLM's `cache_salt`) accepted
    salt_ignored: bool = False  # ... but a second salt was served the first one's cache
    cached_tokens: bool = False  # usage.prompt_tokens_details.cached_tokens
    streaming: bool = False
    stream_usage: bool = False  # stream_options.include_usage
    chars_per_token: float = 1.0  # text prompts: characters per prompt token (from usage)
    models: list[str] = field(default_factory=list)
    # /v1/models' cards as listed: id, root (the weights' path) and parent (an adapter's base),
    # each None where the server does not say: the models suite tells adapters from aliases
    model_cards: list[dict[str, str | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what is missing and why

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def build_body(
    cfg: AuditConfig,
    caps: Capabilities,
    payload: list[int] | str,
    max_tokens: int,
    salt: str | None = None,
    stream: bool = False,
    model: str | None = None,
) -> dict[str, Any]:
    """A greedy request using every option the server was found to accept, to `model` (None:
    --model)."""
    body: dict[str, Any] = {"model": model or cfg.model, "max_tokens": max_tokens, "temperature": 0}
    if caps.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": payload}]
        if caps.logprobs:
            body.update(logprobs=True, top_logprobs=TOP_K)
    else:
        body["prompt"] = payload
        if caps.logprobs:
            body["logprobs"] = TOP_K
    for name, on in (("seed", caps.seed), ("ignore_eos", caps.ignore_eos)):
        if on:
            body[name] = 0 if name == "seed" else True
    if caps.return_token_ids:
        body["return_token_ids"] = True
    if caps.tokens_as_ids:
        body["return_tokens_as_token_ids"] = True
    if salt is not None:
        body["cache_salt"] = salt
    if stream:
        body["stream"] = True
        if caps.stream_usage:
            body["stream_options"] = {"include_usage": True}
    return body


class Prober:
    """Finds the capabilities, one question per request."""

    def __init__(self, cfg: AuditConfig, client: AuditClient) -> None:
        self.cfg, self.client = cfg, client
        self.caps = Capabilities()

    def run(self) -> Capabilities:
        self._models()
        self._endpoint()
        if self.caps.endpoint == "completions":
            self._id_prompts()
        if not (self.caps.text_prompts or self.caps.id_range):
            raise ServerIncompatible("the server accepted neither text nor token-id prompts")
        self._logprobs()
        for name, value in (("seed", 0), ("ignore_eos", True), ("cache_salt", "kvpage-probe")):
            setattr(self.caps, name, self._accepts({name: value}, name))
        self._token_ids()
        self._streaming()
        if self.caps.cache_salt:
            self._salt_separates()
        if self.caps.text_prompts:
            self._chars_per_token()
        self._second_key()
        return self.caps

    # --- the questions ------------------------------------------------------------------------
    def _models(self) -> None:
        try:
            body = self.client.get_json("/v1/models", self.cfg.api_key)
        except RequestRejected as err:
            self.caps.notes.append(f"/v1/models: {err} (model name not checked)")
            return
        cards = [m for m in body.get("data") or [] if isinstance(m, dict)]
        self.caps.models = [str(m.get("id")) for m in cards]
        self.caps.model_cards = [_card(m) for m in cards]
        if self.caps.models and self.cfg.model not in self.caps.models:
            self.caps.notes.append(
                f"/v1/models lists {self.caps.models}, not {self.cfg.model!r}: requests may fail"
            )

    def _endpoint(self) -> None:
        try:
            self._ask(" hello there", {})
            self.caps.text_prompts = True
            return
        except RequestRejected as err:
            if err.status not in (404, 405):  # the route exists; text prompts may not
                self.caps.notes.append(f"text prompts refused on /v1/completions ({err})")
                return
            self.caps.notes.append(f"/v1/completions absent ({err}); using chat completions")
        self.caps.endpoint = "chat"
        try:
            self._ask(" hello there", {})
        except RequestRejected as err:
            raise ServerIncompatible(
                f"neither /v1/completions nor /v1/chat/completions answered a basic greedy "
                f"request ({err})"
            ) from err
        self.caps.text_prompts = True
        self.caps.notes.append("chat endpoint: prompts are text wrapped in the chat template")

    def _id_prompts(self) -> None:
        for lo, hi in ID_RANGES:
            try:
                self._ask([lo, (lo + hi) // 2, hi - 1], {})
            except RequestRejected:
                continue
            self.caps.id_range = (lo, hi)
            return
        self.caps.notes.append("token-id prompts refused: prompts are random text")

    def _logprobs(self) -> None:
        extra = {"logprobs": True, "top_logprobs": TOP_K} if self.caps.endpoint == "chat" else {}
        extra = extra or {"logprobs": TOP_K}
        try:
            out = self._ask(self._sample_prompt(), extra)
        except RequestRejected as err:
            self.caps.notes.append(f"logprobs refused ({err}): divergences cannot be classed")
            return
        if out.top and len(out.top[0]) >= 2:
            self.caps.logprobs = True
            self.caps.logprobs_field = out.logprobs_field
            self.caps.token_ids_field = out.ids_field  # llama.cpp: ids in the logprob entries
        else:
            self.caps.notes.append(
                "logprobs accepted but not returned: divergences cannot be classed by margin"
            )

    def _token_ids(self) -> None:
        """Ask for output ids where the server offers them (vLLM's `return_token_ids`); ids
        already in the logprob entries (llama.cpp) need no request field."""
        if self.caps.token_ids_field is not None:
            return
        try:
            out = self._ask(self._sample_prompt(), {"return_token_ids": True})
        except RequestRejected:
            out = None
        self.caps.return_token_ids = out is not None and out.ids_field == IDS_FIELD
        if self.caps.return_token_ids:
            self.caps.token_ids_field = IDS_FIELD
        if self.caps.logprobs and self.caps.endpoint == "completions":
            self._tokens_as_ids()
        if self.caps.token_ids_field is None:
            self.caps.notes.append("no output token ids: outputs compared as token strings/text")

    def _tokens_as_ids(self) -> None:
        """vLLM's `return_tokens_as_token_ids`: top-k keys spelled `token_id:N`, so tokens whose
        text decodes alike (byte-fallback pieces) are not merged into one key by the server."""
        extra = {"logprobs": TOP_K, "return_tokens_as_token_ids": True}
        try:
            out = self._ask(self._sample_prompt(), extra)
        except RequestRejected:
            return
        keys = [k for top in out.top or [] for k in top] + list(out.tokens or [])
        self.caps.tokens_as_ids = bool(keys) and all(k.startswith("token_id:") for k in keys)

    def _streaming(self) -> None:
        body = self._body(self._sample_prompt(), {"stream": True})
        for options in ({"stream_options": {"include_usage": True}}, {}):
            self.client.accounting.register({**body, **options})
            try:
                timing = self.client.post_stream(
                    self.caps.path, {**body, **options}, self.cfg.api_key
                )
            except RequestRejected:
                continue
            self.caps.streaming = True
            self.caps.stream_usage = bool(options)
            self.caps.cached_tokens = self.caps.cached_tokens or timing.cached_tokens is not None
            return
        self.caps.notes.append("no streaming: TTFT is measured as the latency of 1-token requests")

    def _salt_separates(self) -> None:
        """A salt the server accepts but ignores would make every "cold" reference warm and
        every "other tenant" the same one: check with usage where it is reported."""
        if not (self.caps.cached_tokens and self.cfg.trust_usage):
            self.caps.notes.append(
                "cache_salt accepted; whether it separates caches is unverified (no cached "
                "tokens reported): the timing suite's second tenant tests it"
            )
            return
        payload = self._long_prompt()
        first, second = (f"kvpage-audit-probe-{secrets.token_hex(8)}" for _ in range(2))
        counts = [
            self._ask(payload, {"cache_salt": salt}).cached_tokens
            for salt in (first, first, second)
        ]
        if not counts[1]:
            self.caps.notes.append("cache_salt: no caching observed, so its effect is unverified")
        elif counts[2]:
            self.caps.salt_ignored = True
            self.caps.notes.append(
                f"cache_salt accepted but not separating caches: another salt was served "
                f"{counts[2]} cached tokens (references cannot be made cold)"
            )

    def _long_prompt(self) -> list[int] | str:
        """A fresh prompt of a few blocks (a random one: nothing cached it before)."""
        rng = random.Random((self.cfg.seed or 0) + 13)
        n = 4 * max(self.cfg.block_sizes) + 3
        if self.caps.id_range is not None:
            return [rng.randrange(*self.caps.id_range) for _ in range(n)]
        return "".join(rng.choice("abcdefghij ") for _ in range(4 * n))

    def _chars_per_token(self) -> None:
        """From usage: the prompt-token difference of two random texts, so overheads cancel."""
        factory = PromptFactory((self.cfg.seed or 0) + 7, None)
        short, long = factory.random(120).text or "", factory.random(360).text or ""
        counts = [self._ask(text, {}).prompt_tokens for text in (short, long)]
        if None in counts or counts[1] <= counts[0]:
            self.caps.notes.append("no usage.prompt_tokens: text lengths in tokens are guesses")
            self.caps.chars_per_token = 4.0
            return
        self.caps.chars_per_token = (len(long) - len(short)) / (counts[1] - counts[0])

    def _second_key(self) -> None:
        if self.cfg.second_api_key is None:
            return
        try:
            self.client.get_json("/v1/models", self.cfg.second_api_key)
        except AuthFailed as err:
            raise AuthFailed(f"--second-api-key: {err}") from err
        except RequestRejected:
            pass

    # --- helpers ------------------------------------------------------------------------------
    def _sample_prompt(self) -> list[int] | str:
        if self.caps.id_range is not None:
            lo, hi = self.caps.id_range
            return [lo + 1, lo + 2, (lo + hi) // 2]
        return " the quick brown fox"

    def _accepts(self, extra: dict[str, Any], name: str) -> bool:
        try:
            self._ask(self._sample_prompt(), extra)
            return True
        except RequestRejected as err:
            self.caps.notes.append(f"{name} refused ({err})")
            return False

    def _body(self, payload: list[int] | str, extra: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.cfg.model, "max_tokens": 1, "temperature": 0}
        key = "messages" if self.caps.endpoint == "chat" else "prompt"
        body[key] = [{"role": "user", "content": payload}] if key == "messages" else payload
        return {**body, **extra}

    def _ask(self, payload: list[int] | str, extra: dict[str, Any]):
        request = self._body(payload, extra)
        self.client.accounting.register(request)
        body, _ = self.client.post(self.caps.path, request, self.cfg.api_key)
        out = parse_body(body, self.caps.endpoint == "chat")
        self.caps.cached_tokens = self.caps.cached_tokens or out.cached_tokens is not None
        return out


def _card(card: dict[str, Any]) -> dict[str, str | None]:
    """What the models suite reads of a /v1/models card (vLLM's shape: an adapter's card names
    its base as `parent`, every card its weights as `root`)."""

    def text(key: str) -> str | None:
        value = card.get(key)
        return str(value) if value not in (None, "") else None

    return {"id": str(card.get("id")), "root": text("root"), "parent": text("parent")}
