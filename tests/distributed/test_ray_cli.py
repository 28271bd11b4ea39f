"""`kvpage serve --replicas 2` as a user runs it: a process that starts its own local Ray, says
where it listens once the replicas are up, serves the OpenAI API, and stops cleanly on Ctrl-C or
SIGTERM (how it waits for them, without Ray: test_stop_signal)."""

from __future__ import annotations

import json
import os
import signal
import sys

import httpx
import pytest

from kvpage.serve_replicas.ray_serve import RAY_ENV, REPLICA_HEADER
from tests.waiting import READY_S, LoggedProcess, as_background_job

from .ray_service import MODEL, free_port

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serve_replicas_end_to_end(tmp_path, stop):
    port, audit = free_port(), tmp_path / "audit.jsonl"
    argv = [sys.executable, "-m", "kvpage.cli", "serve", "--replicas", "2", "--router",
            "round-robin", "--replica-cpus", "0.5", "--port", str(port), "--audit-log", str(audit),
            "--num-blocks", "128"]  # fmt: skip
    env = {**os.environ, **RAY_ENV, "PYTHONUNBUFFERED": "1"}  # the banner, as printed
    # Ctrl-C reaches a process started as a background job too (SIGINT inherited ignored)
    start = as_background_job if stop == signal.SIGINT else None
    proc = LoggedProcess(argv, tmp_path / "serve.log", env=env, cwd=tmp_path, preexec_fn=start)
    try:
        # printed once the replicas are up (Ray's start-up on a loaded machine: READY_S)
        assert "2 replicas on Ray Serve, router round-robin" in proc.wait_for_line("replicas on")
        proc.wait_for_line(f"listening on http://127.0.0.1:{port}")
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0.0}
        replies = [httpx.post(url, json=body, timeout=READY_S) for _ in range(2)]
        assert [r.status_code for r in replies] == [200, 200], proc.log()
        assert len({r.headers[REPLICA_HEADER] for r in replies}) == 2  # round-robin: both
        assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
        # SIGTERM too exits 0: Ray's own handler would exit 1. Ray's shutdown takes a while.
        assert proc.stop(stop) == 0, proc.log()
    finally:
        proc.kill()
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    assert {line["replica"] for line in lines} == {r.headers[REPLICA_HEADER] for r in replies}
