"""HTTP to the audited server, and nothing else: every request goes to the one base URL (no
redirects followed), counts against the request budget, and turns transport and HTTP failures
into the auditor's typed errors.

Real servers close idle keep-alive connections without saying so (llama.cpp's server does), and
the next request on such a connection fails before any answer. Such a request is sent once more
on a fresh connection — only when no byte of the answer had arrived, so nothing the server
generated is ever generated twice unseen — and counted (the report says how many)."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import httpx

from kvpage.audit.accounting import Accounting
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


RECENT = 12  # requests remembered, to show what preceded a server failure


class AuditClient:
    def __init__(self, cfg: AuditConfig, budget: Budget) -> None:
        self.cfg, self.budget = cfg, budget
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        self.http = self._client(limits)
        self.retries: list[dict[str, Any]] = []  # requests resent on a fresh connection
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self._lock, self._sent = threading.Lock(), 0
        self.accounting = Accounting()  # every prompt sent, to bound what may come from cache

    def _client(self, limits: httpx.Limits | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.cfg.root,
            timeout=self.cfg.timeout_s,
            follow_redirects=False,
            limits=limits or httpx.Limits(max_keepalive_connections=0),
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> AuditClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_json(self, path: str, key: str | None) -> dict[str, Any]:
        with self._logged("GET", path, None) as entry:
            response = self._send("GET", path, key, None)
            entry["status"] = response.status_code
        return _json(response)

    def post(self, path: str, body: dict[str, Any], key: str | None) -> tuple[dict, float]:
        """The response body and the request's wall time in seconds."""
        with self._logged("POST", path, body) as entry:
            start = time.perf_counter()
            response = self._send("POST", path, key, body)
            entry["status"] = response.status_code
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
        with self._logged("POST", path, body) as entry:
            start = time.perf_counter()
            response, client = self._open("POST", path, key, body)
            entry["status"] = response.status_code
            try:
                ttft, chunks = _read_stream(response, start, on_first, f"{self.cfg.root}{path}")
            finally:
                response.close()
                if client is not self.http:
                    client.close()
        latency = time.perf_counter() - start
        prompt, cached = _last_usage(chunks)
        return StreamTiming(ttft if ttft is not None else latency, latency, prompt, cached, chunks)

    def alive(self) -> bool:
        """After a failure: does the server still answer at all (a fresh connection, a GET)?"""
        try:
            with self._client() as fresh:
                fresh.get("/v1/models", headers=_headers(self.cfg.api_key))
            return True
        except httpx.TransportError:
            return False

    # --- sending ------------------------------------------------------------------------------
    def _send(self, method: str, path: str, key: str | None, body: dict | None) -> httpx.Response:
        response, client = self._open(method, path, key, body)
        try:
            response.read()  # bytes of the answer have arrived: a failure now is never resent
        except httpx.TransportError as err:
            raise ServerUnreachable(f"{self.cfg.root}{path}: {_reason(err)}") from err
        finally:
            response.close()
            if client is not self.http:
                client.close()
        _raise_for(response)
        return response

    def _open(
        self, method: str, path: str, key: str | None, body: dict | None
    ) -> tuple[httpx.Response, httpx.Client]:
        """The answer's status and headers (the body still to read), and the client it came on.
        A connection that fails before any answer is retried once on a fresh one."""
        self.budget.take()
        try:
            return self._head(self.http, method, path, key, body), self.http
        except httpx.TransportError as err:
            if not _before_answer(err):
                raise ServerUnreachable(f"{self.cfg.root}{path}: {_reason(err)}") from err
            first = err
        self.budget.take()
        with self._lock:
            self.retries.append({"path": path, "error": _reason(first)})
        fresh = self._client()
        try:
            return self._head(fresh, method, path, key, body), fresh
        except httpx.TransportError as err:
            fresh.close()
            raise ServerUnreachable(
                f"{self.cfg.root}{path}: {_reason(err)} (and before that, on a reused "
                f"connection: {_reason(first)})"
            ) from err

    def _head(
        self, client: httpx.Client, method: str, path: str, key: str | None, body: dict | None
    ) -> httpx.Response:
        request = client.build_request(method, path, json=body, headers=_headers(key))
        response = client.send(request, stream=True)
        if response.status_code >= 400:
            with suppress(httpx.TransportError):  # the status alone is the answer
                response.read()
            response.close()
            _raise_for(response)
        return response

    @contextmanager
    def _logged(self, method: str, path: str, body: dict | None) -> Iterator[dict[str, Any]]:
        """Remember the request (what it asked, how it ended) among the last few."""
        with self._lock:
            self._sent += 1
            entry = {"n": self._sent, "method": method, "path": path, **_describe(body)}
            self.recent.append(entry)
        try:
            yield entry
        except RequestRejected as err:
            entry["status"] = err.status
            raise
        except ServerUnreachable as err:
            entry["status"], entry["error"] = None, str(err)
            raise
        except BudgetExhausted:
            entry["error"] = "not sent: the request budget is spent"
            raise


def _before_answer(err: httpx.TransportError) -> bool:
    """Did the connection fail before any byte of the answer? Refused or reset connections and
    a close with nothing sent back are; a timeout is not (the server may be working on it)."""
    if isinstance(err, httpx.RemoteProtocolError):
        return "without sending" in str(err)
    return isinstance(err, httpx.ConnectError | httpx.ReadError | httpx.WriteError)


def _read_stream(
    response: httpx.Response, start: float, on_first: Callable[[], None] | None, where: str
) -> tuple[float | None, list[dict[str, Any]]]:
    ttft, chunks = None, []
    try:
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
        raise ServerUnreachable(f"{where}: {_reason(err)} (mid-stream)") from err
    return ttft, chunks


def _describe(body: dict | None) -> dict[str, Any]:
    """A request in a few fields (never its whole prompt)."""
    if not body:
        return {}
    prompt = body.get("prompt", body.get("messages"))
    size = f"{len(prompt)} ids" if isinstance(prompt, list) and body.get("prompt") else None
    if size is None:
        size = f"{len(json.dumps(prompt))} chars"
    return {
        "prompt": size,
        "max_tokens": body.get("max_tokens"),
        "salted": "cache_salt" in body,
        "stream": bool(body.get("stream")),
    }


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
