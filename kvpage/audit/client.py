"""HTTP to the audited server, and nothing else: every request goes to the one base URL (no
redirects followed), counts against the request budget, and turns transport and HTTP failures
into the auditor's typed errors."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from kvpage.audit.completion import StreamTiming, chunk_has_output, usage_counts
from kvpage.audit.config import AuditConfig
from kvpage.audit.errors import (
    AuthFailed,
    BudgetExhausted,
    RequestRejected,
    ServerUnreachable,
)


class Budget:
    """`--budget-requests`: a thread-safe count of requests; the one over the limit is refused
    before it is sent."""

    def __init__(self, limit: int, on_take: Callable[[int, int], None] | None = None) -> None:
        self.limit, self.used = limit, 0
        self.stop_at: int | None = None  # the running suite's share of the budget ends here
        self._lock = threading.Lock()
        self._on_take = on_take

    @property
    def remaining(self) -> int:
        return self.limit - self.used

    def take(self) -> None:
        with self._lock:
            if self.used >= self.limit:
                raise BudgetExhausted(f"the request budget ({self.limit}) is spent")
            if self.stop_at is not None and self.used >= self.stop_at:
                raise BudgetExhausted("this suite's share of the request budget is spent")
            self.used += 1
            used = self.used
        if self._on_take is not None:
            self._on_take(used, self.limit)


class AuditClient:
    def __init__(self, cfg: AuditConfig, budget: Budget) -> None:
        self.cfg, self.budget = cfg, budget
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        self.http = httpx.Client(
            base_url=cfg.root, timeout=cfg.timeout_s, follow_redirects=False, limits=limits
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> AuditClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_json(self, path: str, key: str | None) -> dict[str, Any]:
        self.budget.take()
        response = self._send("GET", path, key, None)
        return _json(response)

    def post(self, path: str, body: dict[str, Any], key: str | None) -> tuple[dict, float]:
        """The response body and the request's wall time in seconds."""
        self.budget.take()
        start = time.perf_counter()
        response = self._send("POST", path, key, body)
        return _json(response), time.perf_counter() - start

    def post_stream(
        self,
        path: str,
        body: dict[str, Any],
        key: str | None,
        on_first: Callable[[], None] | None = None,
    ) -> StreamTiming:
        """A streamed request, timed to its first chunk with output (`on_first` is called
        then, while the rest streams); usage from the last chunk."""
        self.budget.take()
        start = time.perf_counter()
        ttft, chunks = None, []
        try:
            with self.http.stream("POST", path, json=body, headers=_headers(key)) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for(response)
                for line in response.iter_lines():
                    chunk = _sse_data(line)
                    if chunk is None:
                        continue
                    if isinstance(chunk.get("error"), dict):  # failed after the 200 was sent
                        raise RequestRejected(500, str(chunk["error"].get("message", chunk)))
                    if ttft is None and chunk_has_output(chunk):
                        ttft = time.perf_counter() - start
                        if on_first is not None:
                            on_first()
                    chunks.append(chunk)
        except httpx.TransportError as err:
            raise ServerUnreachable(f"{self.cfg.root}{path}: {_reason(err)}") from err
        latency = time.perf_counter() - start
        prompt, cached = _last_usage(chunks)
        return StreamTiming(ttft if ttft is not None else latency, latency, prompt, cached, chunks)

    def _send(self, method: str, path: str, key: str | None, body: dict | None) -> httpx.Response:
        try:
            response = self.http.request(method, path, json=body, headers=_headers(key))
        except httpx.TransportError as err:
            raise ServerUnreachable(f"{self.cfg.root}{path}: {_reason(err)}") from err
        _raise_for(response)
        return response


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _raise_for(response: httpx.Response) -> None:
    status = response.status_code
    if status < 300:
        return
    message = _error_message(response)
    if status in (401, 403):
        raise AuthFailed(f"HTTP {status} from {response.request.url}: {message}")
    raise RequestRejected(status, message)


def _error_message(response: httpx.Response) -> str:
    """OpenAI's `{"error": {"message": ...}}`, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:200] or response.reason_phrase
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])[:300]
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])[:300]
    return json.dumps(body)[:300]


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError as err:
        raise RequestRejected(response.status_code, "the answer is not JSON") from err
    if not isinstance(body, dict):
        raise RequestRejected(response.status_code, "the answer is not a JSON object")
    return body


def _sse_data(line: str) -> dict[str, Any] | None:
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if not data or data == "[DONE]":
        return None
    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None


def _last_usage(chunks: list[dict[str, Any]]) -> tuple[int | None, int | None]:
    for chunk in reversed(chunks):
        if chunk.get("usage"):
            return usage_counts(chunk["usage"])
    return None, None


def _reason(err: httpx.TransportError) -> str:
    text = str(err) or type(err).__name__
    return f"{type(err).__name__}: {text}" if text != type(err).__name__ else text
