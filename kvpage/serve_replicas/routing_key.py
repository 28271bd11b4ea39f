"""The routing key of an HTTP request: (namespace, prompt tokens), computed at the ingress.

The key is a best guess made before the replica sees the request: a body the replica will reject
(bad JSON, unknown fields, a wrong API key) still gets a key — an empty prompt, so it goes to the
least-loaded replica — and the replica answers it exactly as the single server would. The
namespace is the tenant of the API key, or on an open server the client's cache_salt: the same
partition the replicas' prefix caches use, so a routing entry never crosses tenants. A request
naming a model other than the base's (a LoRA adapter) has that name in its namespace too, as
the replicas key adapters apart: its prefix follows the replica that cached it with it. The key
names that adapter too, so the router sends the request only to a replica that holds it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from kvpage.model.tokenizer import Tokenizer
from kvpage.serve_replicas.adapter_holdings import BASE
from kvpage.serve_replicas.prefix_router import RoutingKey
from kvpage.server.chat import ChatTemplate, Conversation
from kvpage.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvpage.server.tenants import Tenants

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
UNROUTED = RoutingKey("", ())  # no prefix to follow: least-loaded


@dataclass(slots=True)
class RoutingKeys:
    tenants: Tenants  # API keys only: the salts are the replicas' business
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate
    base_names: frozenset[str] = frozenset()  # the base model's names: no adapter

    def key(self, path: str, authorization: str | None, body: bytes) -> RoutingKey:
        if path not in (COMPLETIONS, CHAT):
            return UNROUTED
        try:
            raw = json.loads(body)
            namespace, adapter = self._namespace(authorization, raw)
            return RoutingKey(namespace, tuple(self._tokens(path, raw)), adapter)
        except (ValueError, TypeError, AttributeError, ApiError, ValidationError):
            return UNROUTED  # the replica will say what is wrong with it

    def _namespace(self, authorization: str | None, raw: dict) -> tuple[str, str]:
        """(namespace, adapter): the adapter is "" for the base model."""
        tenant = self.tenants.authenticate(authorization)  # 401 there, UNROUTED here
        salt = raw.get("cache_salt")
        if tenant is not None:
            namespace = f"tenant:{tenant}"
        else:
            namespace = f"salt:{salt}" if isinstance(salt, str) else "open"
        model = raw.get("model")
        if isinstance(model, str) and model and model not in self.base_names:
            namespace += f"|adapter:{len(model)}:{model}"  # length-prefixed: no collisions
            return namespace, model
        return namespace, BASE

    def _tokens(self, path: str, raw: dict) -> list[int]:
        if path == COMPLETIONS:
            prompt = CompletionRequest.model_validate(raw).single_prompt()
            return self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        chat = ChatCompletionRequest.model_validate(raw)
        # as the replica renders and encodes it (kvpage.server.app): a model's own template
        # spells its special tokens
        text = self.chat_template.render(Conversation.of(chat))
        return self._encode(text, self.chat_template.builtin)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            return []
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
