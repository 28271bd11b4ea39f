"""The suites' view of the server: greedy completions of a prompt as one tenant, timed first
tokens, and several requests released together (concurrency the server must batch)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from kvpage.audit.accounting import Sent
from kvpage.audit.capabilities import Capabilities, build_body
from kvpage.audit.client import AuditClient
from kvpage.audit.completion import Completion, merge_chunks, parse_body
from kvpage.audit.config import AuditConfig
from kvpage.audit.probes import Prompt

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request claims to be: an API key and/or a cache salt, and the model it names
    (None: --model; the models suite sends the same prefix under each listed model)."""

    name: str
    key: str | None
    salt: str | None = None
    model: str | None = None


class AuditSession:
    def __init__(self, cfg: AuditConfig, client: AuditClient, caps: Capabilities) -> None:
        self.cfg, self.client, self.caps = cfg, client, caps
        self.primary = Tenant("primary", cfg.api_key)

    def complete(
        self, prompt: Prompt, max_tokens: int | None = None, tenant: Tenant | None = None
    ) -> Completion:
        tenant = tenant or self.primary
        tokens = max_tokens or self.cfg.max_tokens
        body = build_body(
            self.cfg, self.caps, prompt.payload, tokens, tenant.salt, model=tenant.model
        )
        sent = self.client.accounting.register(body)
        data, latency = self.client.post(self.caps.path, body, tenant.key)
        out = parse_body(data, self.caps.endpoint == "chat")
        out.latency_s = latency
        return self._accounted(sent, prompt, out)

    def first_token(self, prompt: Prompt, tenant: Tenant | None = None) -> Completion:
        """A 1-token request timed to its first output (streamed where the server can)."""
        tenant = tenant or self.primary
        if not self.caps.streaming:
            out = self.complete(prompt, 1, tenant)
            out.ttft_s = out.latency_s
            return out
        body = build_body(
            self.cfg, self.caps, prompt.payload, 1, tenant.salt, stream=True, model=tenant.model
        )
        sent = self.client.accounting.register(body)
        timing = self.client.post_stream(self.caps.path, body, tenant.key)
        out = Completion("", ttft_s=timing.ttft_s, latency_s=timing.latency_s)
        out.prompt_tokens, out.cached_tokens = timing.prompt_tokens, timing.cached_tokens
        return self._accounted(sent, prompt, out)

    def stream(
        self,
        prompt: Prompt,
        max_tokens: int,
        tenant: Tenant | None = None,
        on_first: Callable[[], None] | None = None,
    ) -> Completion:
        """A streamed completion; `on_first` runs when its first token arrives (so another
        request can be sent while this one decodes)."""
        tenant = tenant or self.primary
        body = build_body(
            self.cfg, self.caps, prompt.payload, max_tokens, tenant.salt, True, tenant.model
        )
        sent = self.client.accounting.register(body)
        timing = self.client.post_stream(self.caps.path, body, tenant.key, on_first)
        out = merge_chunks(timing.chunks, self.caps.endpoint == "chat")
        out.ttft_s, out.latency_s = timing.ttft_s, timing.latency_s
        return self._accounted(sent, prompt, out)

    def _accounted(self, sent: Sent, prompt: Prompt, out: Completion) -> Completion:
        """The answer, with the most tokens the audit had shared with its prompt (phantom hits
        beyond that are recorded by the accounting)."""
        out.shared_bound = self.client.accounting.check(sent, out.cached_tokens, prompt.describe())
        out.prompt_ids = prompt.ids
        return out

    def concurrently(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        """Run the calls at once: each thread waits at a barrier, so they reach the server
        together and share its batches. Results in call order; the first error is raised."""
        barrier = threading.Barrier(len(calls))

        def released(call: Callable[[], T]) -> T:
            barrier.wait()
            return call()

        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            futures = [pool.submit(released, call) for call in calls]
            return [f.result() for f in futures]

    def salted(self, name: str, salt: str) -> Tenant:
        return Tenant(name, self.cfg.api_key, salt)
