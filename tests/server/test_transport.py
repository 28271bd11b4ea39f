"""The HTTP edge: request bodies over the limit are 413 before parsing, a keyed server
authenticates before it parses, and shutdown drains (503 for new work and /health, in-flight
requests get the timeout, streams still running then end with an error event)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer
from tests.waiting import READY_S, answers, wait_until

from .conftest import ADMIN, MODEL

LIMIT = 2048


class SlowEngine(LLMEngine):
    """An engine whose steps take a while, so requests are still running when the test acts."""

    step_delay = 0.02

    def step(self):
        time.sleep(self.step_delay)
        return super().step()


def _server(engine_cls=LLMEngine, **options) -> BackgroundServer:
    engine = engine_cls(EngineConfig(model=MODEL, num_blocks=256, max_num_seqs=8))
    opts = ServerOptions(model_name=MODEL, admin_token=ADMIN, shadow_rate=0.0, **options)
    return BackgroundServer(create_app(engine, opts))


@pytest.fixture(scope="module")
def small_body() -> Iterator[BackgroundServer]:
    with _server(max_body_bytes=LIMIT) as server:
        yield server


def _completion(url: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _assert_openai_error(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == kind


# --- body size -------------------------------------------------------------------------------
def test_default_body_limit_is_4_mib():
    assert ServerOptions().max_body_bytes == 4 * 1024 * 1024


def test_body_over_the_limit_is_413(small_body):
    assert _completion(small_body.url, "x" * (LIMIT // 4)).status_code == 200
    r = _completion(small_body.url, "x" * LIMIT)
    _assert_openai_error(r, 413, "invalid_request_error")
    assert str(LIMIT) in r.json()["error"]["message"]


def test_chunked_body_over_the_limit_is_413(small_body):
    """No Content-Length: the limit is enforced while reading."""
    body = json.dumps({"model": MODEL, "prompt": "y" * 3 * LIMIT, "max_tokens": 2}).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 512):
            yield body[i : i + 512]

    url, headers = f"{small_body.url}/v1/completions", {"Content-Type": "application/json"}
    r = httpx.post(url, content=chunks(), headers=headers, timeout=60)
    _assert_openai_error(r, 413, "invalid_request_error")
    small = json.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 2}).encode()
    r = httpx.post(url, content=iter([small]), headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def test_default_limit_rejects_a_5_mib_body(open_server):
    r = _completion(open_server.url, "z" * (5 * 1024 * 1024))
    _assert_openai_error(r, 413, "invalid_request_error")
    assert open_server.metrics()["kvpage_http_requests_total{path=/v1/completions,status=413}"] >= 1


# --- body read timeout ------------------------------------------------------------------------
def test_default_body_read_timeout_is_30_s():
    assert ServerOptions().body_read_timeout == 30.0


def _read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_stalled_body_is_408_and_leaves_nothing_behind():
    """Headers promise 1000 bytes, 10 come, then nothing: after the read timeout the client
    gets a 408 in OpenAI's shape, the connection closes, and the engine never saw a request."""
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=64, max_num_seqs=4))
    options = ServerOptions(model_name=MODEL, shadow_rate=0.0, body_read_timeout=0.5)
    app = create_app(engine, options)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvpage\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with BackgroundServer(app) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
            sock.sendall(head + b'{"prompt":')  # 10 of the 1000 bytes, then a stall
            start = time.monotonic()
            raw = _read_until_closed(sock)  # the server closes it (old code: a 20 s timeout)
        assert time.monotonic() - start < 15
        status_line, _, rest = raw.partition(b"\r\n")
        assert status_line.split()[1] == b"408", raw
        error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and "0.5 s" in error["message"]
        state = app.state.server
        assert state.loop.in_flight == 0 and not engine.has_unfinished_requests()
        assert engine.stats()["private_blocks"] == 0
        # the server still serves
        assert _completion(server.url, "after the stall").status_code == 200


# --- authentication before parsing -----------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_keyed_server_answers_401_to_a_malformed_unauthenticated_body(tenant_server, headers):
    for content in (b"{not json", b'{"prompt": 12, "max_tokens": "many"}', b"x" * 10**7):
        r = httpx.post(
            f"{tenant_server.url}/v1/completions", content=content, headers=headers, timeout=60
        )
        _assert_openai_error(r, 401, "authentication_error")


def test_keyed_server_parses_once_authenticated(tenant_server):
    headers = {
        "Authorization": f"Bearer {tenant_server.api_key}",
        "Content-Type": "application/json",
    }
    r = httpx.post(
        f"{tenant_server.url}/v1/completions", content=b"{not json", headers=headers, timeout=60
    )
    assert r.status_code == 400, r.text


def test_open_endpoints_need_no_key(tenant_server):
    assert httpx.get(f"{tenant_server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{tenant_server.url}/metrics", timeout=10).status_code == 200


# --- draining and shutdown -------------------------------------------------------------------
def test_health_is_503_while_draining(small_body):
    headers = {"X-Admin-Token": ADMIN}
    httpx.post(f"{small_body.url}/admin/drain", json={"enabled": True}, headers=headers)
    try:
        r = httpx.get(f"{small_body.url}/health", timeout=10)
        assert r.status_code == 503 and r.json()["draining"] is True
    finally:
        httpx.post(f"{small_body.url}/admin/drain", json={"enabled": False}, headers=headers)
    assert httpx.get(f"{small_body.url}/health", timeout=10).status_code == 200


class Stream(threading.Thread):
    """A streamed completion read in the background: its SSE data lines, in order."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        body = {
            "model": MODEL,
            "prompt": "drain me",
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: ") :])
                    self.started.set()

    def finish_reason(self) -> str | None:
        chunks = [json.loads(e) for e in self.events[:-1]]
        return chunks[-1]["choices"][0]["finish_reason"] if chunks else None


def _close_in_background(server: BackgroundServer) -> threading.Thread:
    closer = threading.Thread(target=server.close, daemon=True)
    closer.start()
    return closer


def _wait_draining(url: str) -> httpx.Response:
    wait_until(answers(f"{url}/health", 503), "/health reporting draining")
    return httpx.get(f"{url}/health", timeout=READY_S)


def _wait_running(url: str, requests: int) -> None:
    """Until the engine has `requests` requests in (running or waiting)."""

    def running() -> bool:
        stats = httpx.get(f"{url}/admin/stats", headers={"X-Admin-Token": ADMIN}, timeout=60)
        body = stats.json()
        return body["running"] + body["waiting"] >= requests

    wait_until(running, f"{requests} requests in the engine")


def test_shutdown_lets_in_flight_requests_finish():
    server = _server(SlowEngine, shutdown_timeout=30.0).__enter__()
    stream = Stream(server.url, max_tokens=40)  # ~1 s at 20 ms a step
    stream.start()
    assert stream.started.wait(READY_S)
    start = time.monotonic()
    closer = _close_in_background(server)
    assert _wait_draining(server.url).json()["draining"] is True
    late = _completion(server.url, "late")
    _assert_openai_error(late, 503, "service_unavailable")
    assert "shutting down" in late.json()["error"]["message"]
    stream.join(30)
    closer.join(30)
    assert not closer.is_alive() and time.monotonic() - start < 15
    assert stream.events[-1] == "[DONE]" and stream.finish_reason() == "length"
    assert not any('"error"' in e for e in stream.events)


def test_shutdown_timeout_ends_streams_with_an_error_event():
    server = _server(SlowEngine, shutdown_timeout=0.5).__enter__()
    stream = Stream(server.url, max_tokens=2000)  # ~40 s: far past the timeout
    stream.start()
    assert stream.started.wait(READY_S)
    waiting = threading.Thread(
        target=lambda: setattr(waiting, "r", _completion(server.url, "slow", max_tokens=1500)),
        daemon=True,
    )
    waiting.start()
    _wait_running(server.url, 2)  # the non-streamed request is in flight too
    start = time.monotonic()
    closer = _close_in_background(server)
    stream.join(20)
    waiting.join(20)
    closer.join(20)
    assert not closer.is_alive() and time.monotonic() - start < 10
    assert stream.events[-1] == "[DONE]"
    error = json.loads(stream.events[-2])["error"]
    assert "shutting down" in error["message"] and error["type"] == "service_unavailable"
    _assert_openai_error(waiting.r, 503, "service_unavailable")
    assert "shutting down" in waiting.r.json()["error"]["message"]


def test_drain_and_shutdown_refuse_with_one_error_type(small_body):
    """Both are 503 `service_unavailable` (a client retries elsewhere either way); the message
    says which one it is."""
    headers = {"X-Admin-Token": ADMIN}
    httpx.post(f"{small_body.url}/admin/drain", json={"enabled": True}, headers=headers)
    try:
        r = _completion(small_body.url, "drained")
    finally:
        httpx.post(f"{small_body.url}/admin/drain", json={"enabled": False}, headers=headers)
    _assert_openai_error(r, 503, "service_unavailable")
    assert "draining" in r.json()["error"]["message"]
    assert "shutting down" not in r.json()["error"]["message"]
