"""Waiting for servers in tests: one deadline, generous enough for a loaded machine (a CI box
running other suites, Ray starting its workers), that never passes early — each wait polls a
condition that says the server is ready, never sleeps a fixed time — and that fails with the
server's own log, so a server that did not come up says why.

`wait_until` is the loop; `settled` the same for a server's state after a test's requests,
returning what it saw last for the test to assert on; `LoggedProcess` is a server subprocess
whose output goes to a file, so its log can be shown when it fails (a pipe nobody reads could
also fill up and block it)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TypeVar

import httpx

READY_S = 180.0  # how long a server may take to get ready (or to stop) on a loaded machine
POLL_S = 0.05  # between two looks at the condition: a poll interval, not a wait for readiness
LOG_TAIL = 60  # lines of a server's log shown when it fails
T = TypeVar("T")


def wait_until(
    ready: Callable[[], bool],
    what: str,
    timeout: float = READY_S,
    log: Callable[[], str] = lambda: "",
    alive: Callable[[], bool] = lambda: True,
    poll: float = POLL_S,
) -> None:
    """Return once `ready()` is true; fail once `alive()` turns false (the server exited) or
    after `timeout` seconds, with `log()` (the server's output) in the message."""
    deadline = time.monotonic() + timeout
    while not ready():
        if not alive():
            raise AssertionError(f"the server exited while waiting for {what}; its log:\n{log()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f} s; the server's log:\n{log()}")
        time.sleep(poll)


def settled(fetch: Callable[[], T], done: Callable[[T], bool], timeout: float = READY_S) -> T:
    """Poll `fetch()` until `done` holds for its value, or `timeout` seconds; the last value
    either way, for the caller's assertion to show (a server settling after a test's requests:
    aborts and frees run on its engine thread, between steps)."""
    deadline = time.monotonic() + timeout
    while not done(value := fetch()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return value


def answers(url: str, status: int = 200) -> Callable[[], bool]:
    """A readiness condition: GET `url` answers `status` (a refused connection is not yet)."""

    def check() -> bool:
        try:
            return httpx.get(url, timeout=5).status_code == status
        except httpx.TransportError:
            return False

    return check


def as_background_job() -> None:
    """A `preexec_fn`: SIGINT ignored, as a non-interactive shell starts a background job
    (`make test &`, a CI runner's) and as its children inherit it (Python keeps it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class LoggedProcess:
    """A server subprocess in its own session, its stdout and stderr in `log_path`."""

    def __init__(self, argv: list[str], log_path: Path, **popen) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self, lines: int = LOG_TAIL) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float = READY_S) -> None:
        wait_until(ready, what, timeout, self.log, self.alive)

    def wait_for_line(self, text: str, timeout: float = READY_S) -> str:
        """The first line of its output that contains `text` (once it has been written)."""
        found: list[str] = []

        def printed() -> bool:
            found[:] = [ln for ln in self.log(lines=10**6).splitlines() if text in ln][:1]
            return bool(found)

        self.wait_for(printed, repr(text), timeout)
        return found[0]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = READY_S) -> int:
        """Send `sig` and wait for the exit (failing with its log if it does not come); its
        exit status."""
        with suppress(ProcessLookupError):
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"no exit {timeout:.0f} s after signal {sig}; its log:\n{self.log()}"
            ) from None

    def kill(self) -> None:
        """Its whole process group, whatever state it is in (the test's clean-up): children
        it started (Ray's) may outlive it."""
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
