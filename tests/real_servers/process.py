"""A server process for the real-server tests: started in its own process group, waited for by
polling its /v1/models until a generous deadline (never a fixed sleep), stopped with its whole
group (vLLM's engine core is a child). A server that dies or never gets ready fails the test
with its own log's tail."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from tests.waiting import answers, wait_until

LOG_TAIL = 40  # lines of the server's log shown when it fails


@dataclass(frozen=True, slots=True)
class Served:
    url: str
    log: Path
    process: subprocess.Popen

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = LOG_TAIL) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_process(
    cmd: list[str], env: dict[str, str], url: str, log: Path, ready_s: float
) -> Iterator[Served]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    served = Served(url, log, proc)
    try:
        _wait_ready(served, ready_s)
        yield served
    finally:
        _stop(proc)


def _wait_ready(served: Served, ready_s: float) -> None:
    ready = answers(f"{served.url}/v1/models")
    wait_until(ready, "/v1/models answering 200", ready_s, served.log_tail, served.alive, 0.5)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the group, SIGKILL after 30 s; the group id is the child's own pid. Then a
    SIGKILL sweep: children (vLLM's engine core) may outlive their parent."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
