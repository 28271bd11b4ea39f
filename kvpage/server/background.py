"""A real uvicorn server on loopback in a background thread, for tests and the load benchmark."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """`with BackgroundServer(app) as server:` ... `server.url` is `http://127.0.0.1:PORT`."""

    def __init__(self, app: FastAPI, port: int | None = None, start_timeout: float = 30.0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self._start_timeout = start_timeout

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if not self._thread.is_alive():
                break
            time.sleep(0.05)
        self.close()
        raise RuntimeError(f"server on {self.url} did not answer /health")

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(15.0)

    def __exit__(self, *exc) -> None:
        self.close()
