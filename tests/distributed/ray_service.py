"""Two kvpage applications on one local Ray Serve instance, for the Ray tests: 2 replicas of
builtin:tiny-llama behind the prefix-affinity router at /prefix, and 2 behind round-robin at /rr.
API keys for tenants alice and bob; every audit line kept, in one file per application."""

from __future__ import annotations

import json
import os
import secrets
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import openai
import ray
from ray import serve

from kvpage.config import EngineConfig
from kvpage.serve_replicas import ray_serve
from kvpage.serve_replicas.asgi_call import HttpCall, ResponseStart
from kvpage.serve_replicas.prefix_router import RouterConfig
from kvpage.serve_replicas.routing_key import UNROUTED
from kvpage.server import ServerOptions
from tests.waiting import answers, wait_until

MODEL = "builtin:tiny-llama"
KEYS = {"key-alice": "alice", "key-bob": "bob"}
ADMIN = "ray-admin-token"
APPS = {"prefix": "prefix", "rr": "round-robin"}  # application (and route prefix) -> router


@dataclass
class App:
    name: str
    url: str  # .../<name>
    audit_path: Path

    def client(self, key: str = "key-alice") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def post(self, path: str, body: dict, key: str = "key-alice") -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=120)

    def handle(self):
        return serve.get_deployment_handle(ray_serve.ENGINE_DEPLOYMENT, self.name)

    def reports(self) -> dict[str, ray_serve.ReplicaReport]:
        """Every live replica's report (Ray's broadcast; a dead replica's error is left out)."""
        replies = self.handle().broadcast("report").results(timeout_s=60, return_exceptions=True)
        return {r.replica: r for r in replies if isinstance(r, ray_serve.ReplicaReport)}

    def replica_ids(self) -> list[str]:
        return sorted(self.reports())

    def post_to(self, replica: str, path: str, body: dict, key: str) -> tuple[int, dict]:
        """Straight to one replica (past the router): status and JSON body."""
        headers = [
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-type", b"application/json"),
        ]
        call = _call("POST", path, json.dumps(body).encode(), headers, pin=replica)
        stream = self.handle().options(stream=True).http.remote(call)
        with ThreadPoolExecutor(1) as pool:  # bounded: a call that is never routed fails
            pieces = pool.submit(list, stream).result(timeout=60)
        start = pieces[0]
        assert isinstance(start, ResponseStart) and start.replica == replica
        return start.status, json.loads(b"".join(pieces[1:]))


def _call(method: str, path: str, body: bytes = b"", headers=(), pin: str | None = None):
    return HttpCall(method, path, b"", list(headers), body, UNROUTED, pin=pin)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_log(lines: int = 60) -> str:
    """The tail of Ray Serve's own logs (controller, proxy, replicas) in this Ray session."""
    logs = sorted(Path("/tmp/ray/session_latest/logs/serve").glob("*.log"))
    tails = []
    for path in logs:
        text = path.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"--- {path.name}\n" + "\n".join(text))
    return "\n".join(tails)[-20000:] or "(no Ray Serve logs found)"


def serve_apps(tmp: Path) -> Iterator[dict[str, App]]:
    for name, value in ray_serve.RAY_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    engine = EngineConfig(model=MODEL, num_blocks=256, max_num_seqs=16, enable_lora=True)
    options = ServerOptions(
        model_name=MODEL,
        api_keys=KEYS,
        shadow_rate=0.0,
        tenant_secret=secrets.token_bytes(32),
        admin_token=ADMIN,
    )
    apps = {}
    try:
        for name, policy in APPS.items():
            audit = tmp / f"{name}-audit.jsonl"
            spec = ray_serve.ReplicaSpec(engine, replace(options, audit_log=str(audit)), cpus=0.5)
            config = ray_serve.ServiceConfig(spec, 2, RouterConfig(policy=policy))
            ray_serve.start(config, "127.0.0.1", port, app_name=name, route_prefix=f"/{name}")
            apps[name] = App(name, f"http://127.0.0.1:{port}/{name}", audit)
            # start() returns once Ray calls the replicas up; the ingress must list them too
            ready = answers(f"{apps[name].url}/health")
            wait_until(ready, f"{name}'s /health answering 200", log=serve_log)
        yield apps
    finally:
        serve.shutdown()
        ray.shutdown()
