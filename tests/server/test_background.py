"""BackgroundServer waits for readiness with a deadline for a loaded machine, and a server that
cannot start fails at once (no waiting out the deadline) with what it logged."""

from __future__ import annotations

import time

import pytest

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer

from .conftest import MODEL


def test_the_default_start_deadline_tolerates_a_loaded_machine():
    app = create_app(LLMEngine(EngineConfig(model=MODEL, num_blocks=16)), ServerOptions())
    assert BackgroundServer(app)._start_timeout >= 180


def test_a_server_that_cannot_start_fails_fast_with_its_log():
    app = create_app(LLMEngine(EngineConfig(model=MODEL, num_blocks=16)), ServerOptions())
    state = app.state.server

    def broken_start() -> None:
        raise RuntimeError("engine thread would not start")

    state.loop.start = broken_start  # the app's lifespan start-up fails
    begin = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        BackgroundServer(app).__enter__()
    assert time.monotonic() - begin < 60  # it exited: no waiting out the deadline
    assert "engine thread would not start" in str(failed.value), failed.value
