"""Checks on the raw HTTP request, made before FastAPI reads or parses its body.

The API key comes first: a keyed server answers 401 to a client without a valid key whatever it
sent, so a stranger learns nothing from how its body is judged and costs no parsing. Then the
body's size: more than `max_body_bytes` is a 413, decided from Content-Length when there is one
and otherwise while reading, so an oversized body is never buffered whole nor parsed. And its
time: a body not all in within `body_read_timeout` seconds is a 408 (uvicorn then closes the
connection), so a client that sends headers and part of a body and stalls holds no connection or
task for long, and nothing of it reaches the app or the engine."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpage.server.protocol import ApiError, error_response
from kvpage.server.state import ServerState

_KEYED_PREFIX = "/v1/"  # the OpenAI routes; /admin has its own token, /health and /metrics none
# Metrics label these paths by name and every other path `other`: any path can be asked for, and
# a stranger must not be able to add label values.
_LABELLED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})


class RequestGuard:
    """ASGI middleware: authenticate, then bound the body, then hand over to the app."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._authenticate(scope)
            receive = await self._timed_body(scope, receive)
        except ApiError as err:
            self._count(scope, err.status)
            await error_response(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authenticate(self, scope: Scope) -> None:
        if not scope["path"].startswith(_KEYED_PREFIX):
            return
        header = _header(scope, b"authorization")
        tenant = self.state.tenants.authenticate(header)
        scope.setdefault("state", {})["tenant"] = tenant  # request.state.tenant in the routes

    async def _timed_body(self, scope: Scope, receive: Receive) -> Receive:
        """The whole body within the read timeout (from the headers to its last byte: a client
        trickling a byte at a time is bounded too), or a 408."""
        timeout = self.state.options.body_read_timeout
        try:
            async with asyncio.timeout(timeout):
                return await self._bounded_body(scope, receive)
        except TimeoutError:
            message = f"the request body did not arrive within {timeout:g} s"
            raise ApiError(message, None, 408, "invalid_request_error") from None

    async def _bounded_body(self, scope: Scope, receive: Receive) -> Receive:
        """Read the whole body (at most the limit) and replay it to the app."""
        limit = self.state.options.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left; the app will see it
            size += len(message.get("body", b""))
            if size > limit:
                raise _too_large(limit)
            if not message.get("more_body", False):
                break
        return _replay(messages, receive)

    def _count(self, scope: Scope, status: int) -> None:
        path = scope["path"] if scope["path"] in _LABELLED else "other"
        self.state.metrics.requests.labels(path, str(status)).inc()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _too_large(limit: int) -> ApiError:
    return ApiError(
        f"request body is larger than {limit} bytes", None, 413, "invalid_request_error"
    )


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = deque(messages)

    async def replayed() -> Any:
        return pending.popleft() if pending else await receive()

    return replayed
