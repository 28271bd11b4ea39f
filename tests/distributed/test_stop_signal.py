"""How `kvpage serve --replicas N` waits for its stop (kvpage.cli.serve.wait_for_stop_signal),
without Ray: Ctrl-C and SIGTERM each stop it, also in a process that inherited SIGINT ignored
(what a non-interactive shell gives a background job: `make test &`, a CI runner) and over a
SIGTERM handler of Ray's driver (which exits 1); a second signal while it stops is a
KeyboardInterrupt. The whole service with Ray: test_ray_cli."""

from __future__ import annotations

import signal
import sys

import pytest

from tests.waiting import LoggedProcess, as_background_job

WAITER = """
import signal, sys
ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
from kvpage.cli.serve import wait_for_stop_signal
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # as ray.init installs in a driver
print(f"waiting; SIGINT inherited ignored: {ignored}", flush=True)
wait_for_stop_signal()
try:
    print("stopping", flush=True)
    signal.pause()  # a shutdown that lasts until a second signal cuts it short
except KeyboardInterrupt:
    print("forced", flush=True)
"""


@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stop_signal_ends_the_wait_and_a_second_cuts_the_shutdown_short(tmp_path, first, second):
    argv = [sys.executable, "-c", WAITER]
    proc = LoggedProcess(argv, tmp_path / "waiter.log", preexec_fn=as_background_job)
    try:
        # the condition the fix is for, else the test would pass without it
        proc.wait_for_line("SIGINT inherited ignored: True")
        proc.proc.send_signal(first)
        proc.wait_for_line("stopping")
        assert proc.stop(second) == 0, proc.log()
    finally:
        proc.kill()
    assert "forced" in proc.log()
