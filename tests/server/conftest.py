"""Real uvicorn servers on loopback (free ports), shared by the server tests.

`open_server`: no API keys, so a body `cache_salt` is honoured. `tenant_server`: two API keys
(tenants alice and bob). Both have an admin token, shadow comparison of every cache hit and a full
audit log, and a 64-block pool (so 32 concurrent requests preempt)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpage import LLM, EngineConfig, LLMEngine
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer
from tests.waiting import READY_S, settled

MODEL = "builtin:tiny-llama"
ADMIN = "admin-secret"
KEYS = {"key-alice": "alice", "key-bob": "bob"}
NUM_BLOCKS = 64


@dataclass
class Server:
    url: str
    audit_path: Path
    api_key: str = "unused"

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key or self.api_key, max_retries=0, timeout=60
        )

    def post(self, path: str, body: dict, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key or self.api_key}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=60)

    def admin(self, path: str, body: dict | None = None) -> dict:
        headers = {"X-Admin-Token": ADMIN}
        if body is None:
            r = httpx.get(f"{self.url}/admin/{path}", headers=headers, timeout=30)
        else:
            r = httpx.post(f"{self.url}/admin/{path}", json=body, headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[str, float]:
        """Samples by `name{label=value,...}` (labels sorted), e.g. kvpage_kv_blocks{state=free}."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = READY_S) -> dict:
        """Stats once nothing runs or waits any more (bounded)."""
        return settled(
            lambda: self.admin("stats"),
            lambda s: not (s["running"] or s["waiting"] or s["swapped"]),
            timeout,
        )


def _serve(tmp: Path, name: str, api_keys: dict[str, str]) -> Iterator[Server]:
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=NUM_BLOCKS, max_num_seqs=32))
    audit = tmp / f"{name}-audit.jsonl"
    options = ServerOptions(
        model_name=MODEL, api_keys=api_keys, admin_token=ADMIN, shadow_rate=1.0, audit_log=audit
    )
    with BackgroundServer(create_app(engine, options)) as bg:
        yield Server(bg.url, audit, next(iter(api_keys), "unused"))


@pytest.fixture(scope="session")
def open_server(tmp_path_factory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory.mktemp("open"), "open", {})


@pytest.fixture(scope="session")
def tenant_server(tmp_path_factory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory.mktemp("tenants"), "tenants", KEYS)


@pytest.fixture(scope="session")
def offline() -> LLM:
    """The offline engine the server must agree with, token for token."""
    return LLM(MODEL, num_blocks=256)
