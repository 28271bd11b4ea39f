"""A raw-socket HTTP/1.1 front for another server, with the connection habits of real servers
the audit must survive: llama.cpp's server keeps a connection open after answering (no
`Connection: close`) and then closes it without answering the next request on it. It can also
cut an answer off half-way (bytes sent, then the connection closed), which must never be resent.

Answers are forwarded from the upstream whole (a stream is buffered and sent in one piece)."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx


@dataclass(slots=True)
class Counts:
    received: int = 0  # requests read off the socket
    answered: int = 0
    dropped: int = 0  # read, then the connection closed with nothing sent back
    cut: int = 0  # answered in part, then closed


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream: str, per_connection: int, cut_every: int, stop_after: int):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = httpx.Client(base_url=upstream, timeout=120)
        self.per_connection, self.cut_every = per_connection, cut_every
        self.stop_after, self.stopped = stop_after, threading.Event()
        self.counts, self.lock = Counts(), threading.Lock()

    def die(self) -> None:
        """Like a crashed server: nothing answered any more, new connections refused."""
        if not self.stopped.is_set():
            self.stopped.set()
            threading.Thread(target=self._close, daemon=True).start()

    def _close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        reader = self.request.makefile("rb")
        served = 0
        while (request := _read_request(reader)) is not None:
            with self.server.lock:
                self.server.counts.received += 1
                number = self.server.counts.received
            if self.server.stop_after and number > self.server.stop_after:
                self.server.die()
            if self.server.stopped.is_set() or served >= self.server.per_connection:
                with self.server.lock:
                    self.server.counts.dropped += 1
                return  # the request was read; the connection closes without an answer
            head, body = self._forward(*request)
            if self.server.cut_every and number % self.server.cut_every == 0:
                self.request.sendall(head + body[: len(body) // 2])
                with self.server.lock:
                    self.server.counts.cut += 1
                return
            self.request.sendall(head + body)
            served += 1
            with self.server.lock:
                self.server.counts.answered += 1

    def _forward(self, method: str, path: str, headers: dict, body: bytes) -> tuple[bytes, bytes]:
        keep = {k: v for k, v in headers.items() if k in ("authorization", "content-type")}
        resp = self.server.upstream.request(method, path, content=body, headers=keep)
        kind = resp.headers.get("content-type", "application/json")
        head = (
            f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}\r\n"
            f"Content-Type: {kind}\r\nContent-Length: {len(resp.content)}\r\n\r\n"
        )
        return head.encode(), resp.content


def _read_request(reader) -> tuple[str, str, dict, bytes] | None:
    line = reader.readline()
    if not line.strip():
        return None
    method, path, _ = line.decode().split(" ", 2)
    headers = {}
    while (h := reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = h.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = reader.read(int(headers.get("content-length", 0)))
    return method, path, headers, body


@contextmanager
def closing_front(
    upstream: str, per_connection: int = 1, cut_every: int = 0, stop_after: int = 0
) -> Iterator:
    """(url, counts): each connection answers `per_connection` requests, then drops the next;
    `cut_every` N: every Nth request gets half an answer; `stop_after` N: after N requests the
    server is gone (a crash)."""
    server = _Server(upstream, per_connection, cut_every, stop_after)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.counts
    finally:
        if not server.stopped.is_set():
            server.shutdown()
            server.server_close()
        server.upstream.close()
