"""How `kvpage serve --replicas N` waits for its stop (kvpage.cli.serve.wait_for_stop_signal),
without Ray: Ctrl-C and SIGTERM each stop it, also in a process that inherited SIGINT ignored
(what a non-interactive shell gives a background job: `make test &`, a CI runner) and over a
SIGTERM handler of Ray's driver (which exits 1); a second signal while it stops is a
KeyboardInterrupt. The whole service with Ray: test_ray_cli."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.waiting import LoggedProcess, as_background_job

WAITER = """
import signal, sys
from kvpage.cli.serve import wait_for_stop_signal
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # as ray.init installs in a driver
print("waiting", flush=True)
wait_for_stop_signal()
try:
    print("stopping", flush=True)
    if sys.argv[1] == "again":
        signal.pause()  # a shutdown that lasts until a second signal cuts it short
except KeyboardInterrupt:
    print("forced", flush=True)
"""


def _waiter(tmp_path, then: str) -> LoggedProcess:
    argv = [sys.executable, "-c", WAITER, then]
    proc = LoggedProcess(argv, tmp_path / "waiter.log", preexec_fn=as_background_job)
    proc.wait_for_line("waiting")
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_ends_the_wait_even_with_sigint_inherited_ignored(tmp_path, sig):
    proc = _waiter(tmp_path, "exit")
    try:
        assert proc.stop(sig) == 0, proc.log()
    finally:
        proc.kill()
    assert "stopping" in proc.log()


def test_a_second_signal_cuts_the_shutdown_short(tmp_path):
    proc = _waiter(tmp_path, "again")
    try:
        proc.proc.send_signal(signal.SIGINT)
        proc.wait_for_line("stopping")
        assert proc.stop(signal.SIGTERM) == 0, proc.log()
    finally:
        proc.kill()
    assert "forced" in proc.log()


def test_the_child_really_inherits_sigint_ignored():
    """The precondition the tests above rely on (else they would pass without the fix)."""
    probe = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
    out = subprocess.run(
        [sys.executable, "-c", probe], preexec_fn=as_background_job, capture_output=True, text=True
    )
    assert out.stdout.strip() == "True"
