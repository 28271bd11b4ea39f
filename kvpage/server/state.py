"""Server options and the live state the routes share (one per app)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpage.lora.published import EMPTY, AdapterSnapshot
from kvpage.lora.request import LoRARequest
from kvpage.server.audit import AuditLog
from kvpage.server.chat import ChatTemplate
from kvpage.server.engine_loop import EngineLoop, ServerShutdown
from kvpage.server.metrics import ServerMetrics
from kvpage.server.protocol import ApiError, unavailable
from kvpage.server.shadow import ShadowChecker
from kvpage.server.tenants import Tenants
from kvpage.server.text_stream import TextStream


@dataclass(frozen=True, slots=True)
class ServerOptions:
    model_name: str = "builtin:tiny-llama"  # what /v1/models lists and responses echo
    # Every name a request may use (vLLM's --served-model-name); empty: model_name alone
    served_model_names: tuple[str, ...] = ()
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant; empty: open server
    admin_token: str | None = None  # None: /admin is disabled
    shadow_rate: float = 0.01
    audit_log: str | Path | None = None
    audit_sample_rate: float = 1.0
    seed: int = 0  # sampling of audit lines and shadow checks
    max_body_bytes: int = 4 * 1024 * 1024  # a larger request body is a 413, never parsed
    body_read_timeout: float = 30.0  # seconds for a whole request body to arrive, else a 408
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on shutdown
    # Replicas (kvpage serve --replicas N) share one tenant secret, so a tenant's cache salt is
    # the same on each; None: a secret made at start-up (one process, nothing to agree with).
    tenant_secret: bytes | None = None
    replica: str | None = None  # named in every audit line when the app is one of N replicas
    # vLLM's --lora-modules: (name, PEFT directory) adapters loaded at start-up; a request
    # selects one with `model: name` (the engine needs enable_lora).
    lora_modules: tuple[tuple[str, str], ...] = ()
    # vLLM's --chat-template: a template's text, in place of the model's own (kvpage.server.chat)
    chat_template: str | None = None
    # vLLM's --enable-auto-tool-choice and --tool-call-parser: tool_choice "auto" (the default
    # with tools) parses the reply's tool calls (kvpage.server.tool_calls)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of tool_choice "auto", None where the server does not parse."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


@dataclass(slots=True)
class ServerState:
    options: ServerOptions
    loop: EngineLoop
    metrics: ServerMetrics
    audit: AuditLog
    tenants: Tenants
    shadow: ShadowChecker
    chat_template: ChatTemplate
    draining: bool = False  # refuse new requests, finish running ones (admin switch, shutdown)
    shutting_down: bool = False  # the drain is the shutdown's (the refusals say which)
    # A declared seam (kvpage.server.seams): builds each choice's text stream.
    # make_stream(tokenizer, stop, context=prompt tail) -> TextStream
    text_stream: Callable[..., TextStream] = TextStream
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' `created`

    @property
    def base_names(self) -> tuple[str, ...]:
        return self.options.served_model_names or (self.options.model_name,)

    @property
    def model_names(self) -> tuple[str, ...]:
        """What a request's `model` may name: the base model's names, then every adapter."""
        return (*self.base_names, *self.adapter_names)

    def adapters(self) -> AdapterSnapshot:
        """The engine's adapters as its thread last published them: this (event-loop) thread
        never reads the engine's registry, which load and unload change on the engine thread.
        Take it once per answer: two calls may see two publications."""
        slots = self.loop.engine.lora_slots
        return EMPTY if slots is None else slots.published

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return self.adapters().names

    def adapter_for(self, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names, None for the base model (or no name)."""
        if not model or model in self.base_names:
            return None
        adapter = self.adapters().get(model)
        return None if adapter is None else LoRARequest(adapter.name, adapter.path)

    async def shut_down(self, timeout: float, force: Callable[[], bool] = lambda: False) -> int:
        """Drain: admit nothing more, give the requests in flight up to `timeout` seconds (less
        if `force()` turns true), then end the rest with an error. Returns how many were cut."""
        self.draining = self.shutting_down = True
        deadline = time.monotonic() + timeout
        while self.loop.in_flight and time.monotonic() < deadline and not force():
            await asyncio.sleep(0.05)
        cut = self.loop.in_flight
        if cut:
            self.loop.fail_in_flight(ServerShutdown("the server is shutting down"))
        return cut

    def refusal(self) -> ApiError | None:
        """Why a new request is refused now (a 503), or None when it is admitted."""
        if self.shutting_down:
            return unavailable("the server is shutting down")
        if self.draining:
            return unavailable("the server is draining (an operator turned drain on)")
        return None

    def describe(self) -> list[str]:
        """What this server serves, for the start-up banner. Never a key or a token."""
        engine, opts = self.loop.engine, self.options
        pool_blocks, block_size = engine.cache.pool.num_blocks, engine.config.block_size
        caching = "on" if engine.cache.enable_prefix_caching else "off"
        return [
            f"model: {opts.model_name} ({engine.config.dtype} on {engine.config.device}"
            f"{_split(engine.config.tensor_parallel_size)})",
            f"KV pool: {pool_blocks} blocks x {block_size} tokens = {pool_blocks * block_size} "
            f"tokens, {_mib(engine.storage.nbytes)}, KV {engine.storage.format.describe()}",
            f"prefix caching: {caching}; preemption: {engine.config.preemption_mode}",
            *_speculation(engine.config.speculative_config),
            f"chat template: {self.chat_template.describe()}",
            f"auth: {self._auth()}",
            f"admin API: {'on' if opts.admin_token else 'off (no admin token)'}",
            f"audit log: {opts.audit_log or 'stderr (the kvpage.audit logger)'}",
            f"limits: request body {_mib(opts.max_body_bytes)} "
            f"(in {opts.body_read_timeout:g} s), "
            f"shutdown timeout {opts.shutdown_timeout:g} s",
        ]

    def _auth(self) -> str:
        if not self.tenants.enabled:
            return "off (open server: no API keys, a request may set its own cache_salt)"
        tenants = sorted(set(self.tenants.keys.values()))
        shown = ", ".join(tenants[:_TENANTS_SHOWN])
        more = f" and {len(tenants) - _TENANTS_SHOWN} more" if len(tenants) > _TENANTS_SHOWN else ""
        return f"on ({len(self.tenants.keys)} API keys; {len(tenants)} tenants: {shown}{more})"


_TENANTS_SHOWN = 10


def _speculation(config: dict | None) -> list[str]:
    """The banner's speculative-decoding line, where the engine speculates."""
    return [] if config is None else [f"speculative decoding: {json.dumps(config)}"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _split(tensor_parallel_size: int) -> str:
    if tensor_parallel_size == 1:
        return ""
    return f", tensor parallel over {tensor_parallel_size} processes (gloo)"
