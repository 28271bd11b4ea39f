"""The audit observer's request -> tenant map holds a request only while it runs: whichever way a
parallel (n > 1) stream ends (finished, client gone mid-stream, engine failure), its entry goes
once the engine has settled, so a long-running server does not grow the map without bound."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvpage import EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer
from kvpage.server.state import ServerState
from tests.waiting import wait_until

from .conftest import ADMIN, KEYS, MODEL


class FlakyEngine(LLMEngine):
    """An engine whose step raises when told to (the engine loop fails every live request)."""

    fail_next = False

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected step failure")
        return super().step()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, ServerState]]:
    engine = FlakyEngine(EngineConfig(model=MODEL, num_blocks=256, max_num_seqs=8))
    options = ServerOptions(model_name=MODEL, api_keys=KEYS, admin_token=ADMIN, shadow_rate=0.0)
    app = create_app(engine, options)
    with BackgroundServer(app) as bg:
        yield bg.url, app.state.server


def _stream_body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": "parallel", "n": 2, "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 1.0, "seed": 1}  # fmt: skip


def _stream(url: str, max_tokens: int, stop_after: int | None = None) -> list[str]:
    """The stream's data lines; with `stop_after`, the client hangs up after that many."""
    events: list[str] = []
    headers = {"Authorization": "Bearer key-alice"}
    with httpx.stream("POST", f"{url}/v1/completions", json=_stream_body(max_tokens),
                      headers=headers, timeout=120) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if stop_after is not None and len(events) >= stop_after:
                    break  # leaving the `with` closes the connection mid-stream
    return events


def _settled_map(url: str, state: ServerState) -> dict:
    """The tenant map once the engine runs nothing and every queued command has run."""

    def idle() -> bool:
        stats = httpx.get(f"{url}/admin/stats", headers={"X-Admin-Token": ADMIN}, timeout=60)
        s = stats.json()
        return not (s["running"] or s["waiting"] or s["swapped"]) and not state.loop.in_flight

    wait_until(idle, "the engine to settle", timeout=60)
    # one more engine-thread round trip: the map's clean-up is queued behind the abort
    httpx.get(f"{url}/admin/stats", headers={"X-Admin-Token": ADMIN}, timeout=60)
    return dict(state.audit.tenants)


def test_a_finished_parallel_stream_leaves_no_tenant(served):
    url, state = served
    events = _stream(url, max_tokens=4)
    assert events[-1] == "[DONE]"
    assert _settled_map(url, state) == {}


def test_an_abandoned_parallel_stream_leaves_no_tenant(served):
    url, state = served
    events = _stream(url, max_tokens=2000, stop_after=3)  # long: still running when we leave
    assert "[DONE]" not in events
    assert _settled_map(url, state) == {}


def test_a_parallel_stream_failed_by_the_engine_leaves_no_tenant(served):
    url, state = served
    state.loop.engine.fail_next = True
    events = _stream(url, max_tokens=50)
    assert events[-1] == "[DONE]"
    assert "injected step failure" in json.loads(events[-2])["error"]["message"]
    assert _settled_map(url, state) == {}
