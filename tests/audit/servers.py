"""Servers the audit tests run against, all real HTTP on 127.0.0.1 free ports: kvpage itself
(honest, with a verifier mutant bound through its named seams, or with a test-only seam), and a
small proxy in front of kvpage that turns it into a different server: one that leaks tokens
between concurrent requests, or one that offers only what `transformers serve` offers."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvpage import EngineConfig, LLMEngine
from kvpage.audit import faults
from kvpage.server import ServerOptions, create_app
from kvpage.server.background import BackgroundServer, free_port
from kvpage.verify.lora_adapters import LoraSpec, make_adapter
from kvpage.verify.mutants import MUTANTS
from tests.waiting import wait_until

MODEL = "builtin:tiny-llama"
KEYS = {"key-alice": "alice", "key-bob": "bob"}


@contextmanager
def kvpage_server(
    api_keys: dict[str, str] | None = None,
    num_blocks: int = 256,
    mutant: str | None = None,
    seam: Callable[[LLMEngine], None] | None = None,
    preemption_mode: str = "recompute",
    adapters: tuple[LoraSpec, ...] = (),
) -> Iterator[str]:
    """A kvpage server; `mutant` names a verifier mutant (kvpage.verify.mutants) to apply;
    `adapters`: random LoRA adapters it serves as models of their names (listed in /v1/models
    with the base as parent)."""
    found = {m.name: m for m in MUTANTS}[mutant] if mutant else None
    overrides = dict(found.config) if found else {}
    if adapters:
        overrides.update(enable_lora=True, max_loras=len(adapters))
    config = EngineConfig(
        model=MODEL,
        num_blocks=num_blocks,
        max_num_seqs=32,
        preemption_mode=preemption_mode,
        **overrides,
    )
    engine = LLMEngine(config)
    for spec in adapters:
        engine.lora_slots.register(make_adapter(spec, engine.model.config))
    if found is not None:
        faults.plant(engine, found)  # as `kvpage serve --inject-fault` does, trigger included
    if seam is not None:
        seam(engine)
    options = ServerOptions(model_name=MODEL, api_keys=api_keys or {}, shadow_rate=0.0)
    with BackgroundServer(create_app(engine, options)) as bg:
        yield bg.url


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: server.started, f"uvicorn started on {url}", alive=thread.is_alive)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


class _Overlap:
    """Which requests were in flight at the same time as which (the leak's victims)."""

    def __init__(self) -> None:
        self.active: dict[int, list[int]] = {}
        self.met: dict[int, list[list[int]]] = {}

    def enter(self, rid: int, prompt: list[int]) -> None:
        for other, seen in self.met.items():
            if other in self.active:
                seen.append(prompt)
        self.met[rid] = list(self.active.values())
        self.active[rid] = prompt

    def leave(self, rid: int) -> list[list[int]]:
        self.active.pop(rid, None)
        return self.met.pop(rid, [])


def proxy_app(
    upstream: str,
    leak: bool = False,
    text_only: bool = False,
    phantom: int = 0,
    wrong_alike: bool = False,
    fail_after: int = 0,
) -> FastAPI:
    """`leak`: a completion that overlapped another request gets that request's last 4 prompt
    ids (its canary) written over output tokens 2..5. `text_only`: like `transformers serve`,
    token-id prompts are refused, logprobs and token ids silently dropped, no cached-token
    usage, no cache_salt effect (the field is dropped). `phantom`: every non-streamed answer
    reports that many more cached tokens than it was served (the answers are untouched).
    `wrong_alike`: every non-streamed answer's output token 3 is replaced by another id, the
    same way every time — cold and warm answers agree, and both are wrong. `fail_after` N: every
    non-streamed request after the Nth answers 500, as an engine that broke would."""
    app = FastAPI()
    overlap, counter = _Overlap(), iter(range(10**9))
    clients: dict[str, httpx.AsyncClient] = {}  # one upstream pool (made on the server's loop)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        data = json.loads(raw) if raw else None
        if text_only and isinstance(data, dict):
            if isinstance(data.get("prompt"), list):
                return JSONResponse({"error": {"message": "prompt must be a string"}}, 400)
            for field in (
                "logprobs",
                "top_logprobs",
                "return_token_ids",
                "cache_salt",
                "stream_options",
            ):
                data.pop(field, None)
        client = clients.setdefault("upstream", httpx.AsyncClient(base_url=upstream, timeout=60))
        headers = {"authorization": request.headers.get("authorization", "")}
        if isinstance(data, dict) and data.get("stream"):
            upstream_req = client.build_request("POST", f"/{path}", json=data, headers=headers)
            resp = await client.send(upstream_req, stream=True)
            return StreamingResponse(
                resp.aiter_raw(),
                resp.status_code,
                media_type="text/event-stream",
                background=BackgroundTask(resp.aclose),
            )
        rid = next(counter)
        if fail_after and rid >= fail_after:
            return JSONResponse({"error": {"message": "planted engine failure"}}, 500)
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if leak and isinstance(prompt, list):
            overlap.enter(rid, prompt)
            await asyncio.sleep(0.02)  # widen the window in which requests meet
        try:
            resp = await client.request(request.method, f"/{path}", json=data, headers=headers)
        finally:
            met = overlap.leave(rid)
        body = resp.json()
        if leak and met and resp.status_code == 200:
            _write_canary(body, met[0][-4:])
        if text_only and isinstance(body.get("usage"), dict):
            body["usage"].pop("prompt_tokens_details", None)
        if wrong_alike and resp.status_code == 200:
            _replace_token(body, 3)
        if phantom and isinstance(body.get("usage"), dict):
            details = body["usage"].setdefault("prompt_tokens_details", {})
            details["cached_tokens"] = (details.get("cached_tokens") or 0) + phantom
        return JSONResponse(body, resp.status_code)

    return app


def _write_canary(body: dict, canary: list[int]) -> None:
    choice = body["choices"][0]
    ids = choice.get("token_ids")
    if not ids or len(ids) < 2 + len(canary):
        return
    ids[2 : 2 + len(canary)] = canary
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens:
        tokens[2 : 2 + len(canary)] = [f"token_id:{t}" for t in canary]


def _replace_token(body: dict, index: int) -> None:
    choice = body["choices"][0]
    ids = choice.get("token_ids")
    if not ids or len(ids) <= index:
        return
    ids[index] = 3 + (ids[index] * 7 + 11) % 240  # another byte-level id, deterministically
    lp = choice.get("logprobs") or {}
    if lp.get("tokens"):
        lp["tokens"][index] = f"token_id:{ids[index]}"


def batched_logits_in_bfloat16(engine: LLMEngine) -> None:
    """A test-only seam: logits of a step with several sequences are rounded to bfloat16, as a
    lower-precision batched kernel would leave them. Solo steps are untouched, nothing else
    changes: the outputs differ from solo ones by float rounding only."""
    from kvpage.verify.mutants.base import bind

    original = engine.runner.run

    def run(self, batch):
        out = original(batch)
        if len(batch.scheduled) > 1:
            out.logits = out.logits.to("cpu").bfloat16().float().to(out.logits.device)
        return out

    bind(engine.runner, "run", run)
