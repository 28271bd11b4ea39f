"""uvicorn with a graceful shutdown, for `kvpage serve`; and the same on loopback in a background
thread, for tests and the load benchmark."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI

from kvpage.server.state import ServerState

log = logging.getLogger("kvpage.server")
# After the drain, how long uvicorn waits for connections to close before it cancels them: the
# responses cut by the drain only have their error event and [DONE] left to write.
_CLOSE_GRACE_S = 5


class GracefulServer(uvicorn.Server):
    """On shutdown (SIGINT/SIGTERM, or `should_exit`) the app drains before uvicorn closes its
    sockets: new requests and /health get 503 (a load balancer moves away), requests in flight
    get the app's `shutdown_timeout`, and streams still running then end with an error event. A
    second Ctrl-C cuts the wait short."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timeout = self.state.options.shutdown_timeout
        cut = await self.state.shut_down(timeout, force=lambda: self.force_exit)
        if cut:
            log.warning(json.dumps({"event": "shutdown_cut_requests", "requests": cut}))
        await super().shutdown(sockets)


def graceful_server(app: FastAPI, host: str, port: int, log_level: str) -> GracefulServer:
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=_CLOSE_GRACE_S
    )
    return GracefulServer(config, app.state.server)


def serve(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve until interrupted (what `kvpage serve` runs)."""
    graceful_server(app, host, port, log_level).run()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """`with BackgroundServer(app) as server:` ... `server.url` is `http://127.0.0.1:PORT`.

    Entering waits for /health to answer 200, up to `start_timeout` seconds (generous: a loaded
    machine can be slow to start the engine thread); a server that dies or never gets ready
    raises with what it logged while starting and the exception that ended its thread."""

    def __init__(self, app: FastAPI, port: int | None = None, start_timeout: float = 180.0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = graceful_server(app, "127.0.0.1", self.port, "warning")
        self._stop_timeout = app.state.server.options.shutdown_timeout + 15.0
        self._thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)
        self._start_timeout = start_timeout
        self._failure: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as err:  # uvicorn exits on a failed start-up: say so in __enter__
            self._failure = err

    def __enter__(self) -> BackgroundServer:
        with _StartLog() as start_log:
            self._thread.start()
            deadline = time.monotonic() + self._start_timeout
            while time.monotonic() < deadline and self._thread.is_alive():
                try:
                    if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.05)  # a poll interval, not a wait for readiness
        self.close()
        why = "exited" if not self._thread.is_alive() else f"not ready in {self._start_timeout:g} s"
        raise RuntimeError(
            f"server on {self.url} did not answer /health ({why}); "
            f"its thread's error: {self._failure!r}; its log:\n{start_log.text()}"
        )

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(self._stop_timeout)

    def __exit__(self, *exc) -> None:
        self.close()


class _StartLog(logging.Handler):
    """What uvicorn and kvpage log while a background server starts (for its failure)."""

    _LOGGERS = ("uvicorn", "kvpage")  # uvicorn.error reaches the first

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def text(self) -> str:
        return "\n".join(self.lines) or "(nothing logged)"

    def __enter__(self) -> _StartLog:
        for name in self._LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in self._LOGGERS:
            logging.getLogger(name).removeHandler(self)
