"""The server suite: the OpenAI app driven in-process over ASGI (httpx's ASGITransport, the app's
own lifespan running its engine loop), with generated request sequences, every response compared
with the text oracle and the namespace model (kvpage.verify.stack.compare). Two apps per run:
one with API keys (tenants, their salts made by the server) and an open one (client salts).
Requests go one at a time, so the cache a request may hit is exactly what came before it."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.engine.namespace import base_namespace
from kvpage.kv.format import kv_format
from kvpage.model.quantize import head_quantized, weight_quantization
from kvpage.server import ServerOptions, create_app
from kvpage.server.state import ServerState
from kvpage.verify.checks import Failure
from kvpage.verify.stack.compare import Where, failure
from kvpage.verify.stack.compare import compare as compare_response
from kvpage.verify.stack.expect import CacheModel, Expected, References, expect, follow
from kvpage.verify.stack.responses import parse_body, parse_stream
from kvpage.verify.stack.scenario import TENANTS, AdminEvent, GenRequest, Scenario, make_scenario
from kvpage.verify.stack.text_oracle import text_model
from kvpage.verify.stack.ties import StepRecorder
from kvpage.verify.suites import CaseResult

ADMIN_TOKEN = "stack-admin"
SECRET = b"stack-suite-tenant-secret"  # known here, so the tenants' salts can be computed here
REQUESTS_PER_APP = 22


def key_of(tenant: str) -> str:
    return f"key-{tenant}"


@dataclass(slots=True)
class StackTarget:
    """One app under test: what a server mutant may change (kvpage.server.seams)."""

    app: object
    state: ServerState
    engine: LLMEngine


@dataclass(slots=True)
class Run:
    """The oracle's side of one app's run."""

    scenario: Scenario
    tokenizer: object  # the oracle's (kvpage.verify.stack.text_oracle), never the server's
    refs: References
    cache: CacheModel
    rng: random.Random
    model_name: str
    namespace_hex: Callable[[str | None], str]
    draining: bool = False
    recorder: StepRecorder | None = None  # the engine's draws, where ties are allowed
    failures: list[Failure] = field(default_factory=list)
    requests: int = 0
    coverage: Counter = field(default_factory=Counter)  # what the run exercised, by dimension

    def switches(self) -> str:
        off = sorted(repr(ns) for ns in self.cache.off)
        return f"global {'on' if self.cache.caching else 'off'}; off for {off or 'none'}"


def server_cases(
    model,
    tokenizer,
    model_name: str,
    seed: int,
    deadline: float,
    plant=None,
    first=False,
    label: str = "",
) -> list[CaseResult]:
    """Both apps' cases. `plant(target)`: a server mutant, applied to each app; `first`: stop
    after the first case that fails; `label`: the tokenizer's, in the cases' names
    (`server-open[spm]`) where the stage runs on more than the served one."""
    rng = random.Random(seed)
    oracle = text_model(model_name, tokenizer)  # the served tokenizer, read independently
    refs = References(model)
    results = []
    for with_keys in (True, False):
        scenario = make_scenario(rng, oracle, with_keys, REQUESTS_PER_APP, True, not refs.ties)
        run = _new_run(scenario, model, tokenizer, model_name, refs, rng.randrange(2**32))
        run.tokenizer = oracle
        results.append(_run_case(run, model, tokenizer, model_name, deadline, plant, label))
        if first and not results[-1].passed:
            break
    return results


def _new_run(scenario, model, tokenizer, model_name, refs, seed: int) -> Run:
    fmt = kv_format("auto", model.dtype)
    base = base_namespace(model, tokenizer, scenario.block_size, model_name, fmt)
    cache = CacheModel(scenario.block_size)
    return Run(
        scenario,
        tokenizer,
        refs,
        cache,
        random.Random(seed),
        model_name,
        lambda salt: base.with_salt(salt).digest().hex(),
    )


def _run_case(run: Run, model, tokenizer, model_name, deadline, plant, label) -> CaseResult:
    start = time.perf_counter()
    target = _target(run.scenario, model, tokenizer, model_name)
    if run.refs.ties:  # 16-bit: the reference is followed through the engine's numeric ties
        run.recorder = StepRecorder()
        target.engine.add_observer(run.recorder)
    if plant is not None:
        plant(target)
    asyncio.run(_drive(run, target, deadline))
    name = ("server-tenants" if run.scenario.with_keys else "server-open") + label
    stats = {**target.engine.stats(), "coverage": dict(sorted(run.coverage.items()))}
    seconds = time.perf_counter() - start
    return CaseResult(name, "server", run.failures, run.requests, run.requests, seconds, stats)


def _target(scenario: Scenario, model, tokenizer, model_name: str) -> StackTarget:
    """An engine whose pool holds every token the scenario can write: nothing is evicted."""
    tokens = sum(
        (len(str(p)) * 4 + r.max_tokens + 1) * r.n for r in scenario.requests for p in r.prompts
    )
    config = EngineConfig(
        model=model_name,
        block_size=scenario.block_size,
        num_blocks=tokens // scenario.block_size + 64,
        max_num_seqs=16,
        quantization=weight_quantization(model),  # the model's weights, whatever they are
        quantize_lm_head=head_quantized(model),
    )
    engine = LLMEngine(config, model, tokenizer)
    keys = {key_of(t): t for t in TENANTS} if scenario.with_keys else {}
    options = ServerOptions(
        model_name=model_name,
        api_keys=keys,
        admin_token=ADMIN_TOKEN,
        shadow_rate=0.0,  # the shadow re-check has its own tests; here it would only cost time
        tenant_secret=SECRET,
    )
    app = create_app(engine, options)
    return StackTarget(app, app.state.server, engine)


async def _drive(run: Run, target: StackTarget, deadline: float) -> None:
    app = target.app
    transport = httpx.ASGITransport(app=app)
    client = httpx.AsyncClient(transport=transport, base_url="http://stack")
    async with app.router.lifespan_context(app), client:
        for event in run.scenario.events:
            if time.perf_counter() > deadline and isinstance(event, GenRequest):
                continue  # out of time: the switches still run, so the app ends clean
            if isinstance(event, GenRequest):
                await _request(run, client, event)
            else:
                await _admin(run, client, event)


# --- generation requests -----------------------------------------------------------------------
def _body(req: GenRequest, stops: list[str], stop_ids: tuple[int, ...]) -> dict:
    body: dict = {
        "model": "",
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "n": req.n,
        "stream": req.stream,
        "return_token_ids": req.return_token_ids,
    }
    if req.seed is not None:
        body["seed"] = req.seed
    if stops:
        body["stop"] = stops if len(stops) > 1 else stops[0]
    if stop_ids:
        body["stop_token_ids"] = list(stop_ids)
    if req.stream:
        body["stream_options"] = {"include_usage": req.include_usage}
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    if req.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        if req.logprobs is not None:
            body |= {"logprobs": True, "top_logprobs": req.logprobs}
    else:
        prompts = [p if isinstance(p, str) else list(p) for p in req.prompts]
        body["prompt"] = prompts if len(prompts) > 1 else prompts[0]
        if req.logprobs is not None:
            body["logprobs"] = req.logprobs
        if req.echo:
            body["echo"] = True
    return body


def _headers(req: GenRequest) -> dict[str, str]:
    return {"Authorization": f"Bearer {key_of(req.tenant)}"} if req.tenant else {}


async def _request(run: Run, client: httpx.AsyncClient, req: GenRequest) -> None:
    path = "/v1/chat/completions" if req.chat else "/v1/completions"
    where = Where(req.name, req.stream, run.model_name, run.switches())
    run.requests += 1
    if run.draining:  # the engine never sees it, so neither does the cache model
        return await _refused(client, path, _body(req, [], ()), req, where, run)
    exp = expect(req, run.tokenizer, run.refs, run.cache, run.rng)
    _cover(run.coverage, exp, run.tokenizer.has_template)
    body = _body(req, exp.stops, exp.params.stop_token_ids)
    response = await client.post(path, json=body, headers=_headers(req))
    if req.stream and response.status_code == 200:
        got = parse_stream(response.status_code, response.text, req.chat, req.include_usage)
    else:
        got = parse_body(response.status_code, _json(response), req.chat)
    if run.recorder is not None:
        followed = follow(exp, run.recorder.take(), run.refs, run.tokenizer)
        run.coverage["numeric tie followed"] += followed is not exp
        exp = followed
    run.failures += await _audited(run, client, exp, (got.body or {}).get("id"), where)
    run.failures += compare_response(exp, got, where)


async def _audited(run: Run, client, exp: Expected, request_id, where: Where) -> list[Failure]:
    """The audit log's lines of this request (each engine event) name the namespace its blocks
    were keyed in and its tenant: the tenant's salted namespace, never another's. (A request a
    stop string ended may have no line yet: its abort lands after the response.)"""
    if request_id is None:
        return []
    response = await client.get("/admin/audit", headers={"X-Admin-Token": ADMIN_TOKEN})
    events = response.json().get("events", [])
    req = exp.request
    ids = {request_id} | {f"{request_id}-{i}" for i in range(len(req.prompts))}  # a list's
    mine = [e for e in events if str(e.get("request_id", "")).split("#")[0] in ids]
    salt = _salt(req.tenant) if req.tenant is not None else req.cache_salt
    want = {"namespace": run.namespace_hex(salt), "tenant": req.tenant}
    for event in mine:
        have = {"namespace": event.get("namespace"), "tenant": event.get("tenant")}
        if have != want:
            f = where.fields(None, f"audit {event.get('event')}", want, have)
            f |= {"namespace": repr(exp.namespace), "prompt_tokens": exp.prompt_tokens}
            reason = "the request ran in another namespace than its tenant's"
            return [failure(where, "server_tenancy", reason, f)]
    return []


def _cover(coverage: Counter, exp: Expected, template: bool) -> None:
    req, cuts = exp.request, [c.stop for c in exp.choices if c.stop is not None]
    coverage.update(
        {
            "requests": 1,
            "stream": req.stream,
            "sampled": req.temperature > 0,
            "chat": req.chat,
            "n>1": req.n > 1,
            "echo": req.echo,
            "echo with logprobs": req.echo and req.logprobs is not None,
            "echo, max_tokens 0": req.echo and not req.max_tokens,
            "list of prompts": len(req.prompts) > 1,
            "list of prompts, n>1": len(req.prompts) > 1 and req.n > 1,
            "chat with the model's template": req.chat and template,
            "text past an unstable decode": any(c.stable is not None for c in exp.choices),
            "logprobs": req.logprobs is not None,
            "stop string hit": bool(cuts),
            "stop string with a multi-byte char hit": any(max(map(ord, s)) > 127 for s in cuts),
            "stop token id": bool(exp.params.stop_token_ids),
            "prefix hit": exp.cached_tokens > 0,
            "caching switched off": exp.unswitched_cached > exp.cached_tokens,
        }
    )


def _json(response: httpx.Response) -> dict:
    try:
        return response.json()
    except json.JSONDecodeError:
        return {"unparsed": response.text[:200]}


async def _refused(client, path: str, body: dict, req: GenRequest, where, run: Run) -> None:
    """While draining, a request is a 503."""
    response = await client.post(path, json=body, headers=_headers(req))
    error = _json(response).get("error", {})
    have = (response.status_code, error.get("type"))
    want = (503, "service_unavailable")
    if have != want:
        f = where.fields(None, "drain", want, have) | {"switches": "draining"}
        run.failures.append(failure(where, "server_admin", "a request got in while draining", f))


# --- admin switches and refused requests -------------------------------------------------------
async def _admin(run: Run, client: httpx.AsyncClient, event: AdminEvent) -> None:
    where = Where(f"admin:{event.kind}", False, run.model_name, run.switches())
    run.coverage[f"admin {event.kind} {'on' if event.enabled else 'off'}"] += 1
    if event.kind in ("bad-key", "salt-with-key"):
        return await _refusal(run, client, event, where)
    if event.kind == "drain":
        return await _drain(run, client, event, where)
    body = {"enabled": event.enabled, "tenant": event.tenant, "cache_salt": event.cache_salt}
    body["namespace"] = event.namespace
    response = await client.post(
        f"/admin/{event.kind}", json=body, headers={"X-Admin-Token": ADMIN_TOKEN}
    )
    want = _switch_answer(run, event)
    have = (response.status_code, _json(response))
    if have != (200, want):
        f = where.fields(None, event.kind, want, have) | {"switches": run.switches()}
        run.failures.append(failure(where, "server_admin", "the switch's answer is wrong", f))


def _switch_answer(run: Run, event: AdminEvent) -> dict:
    """What the switch must answer, and its effect on the cache model."""
    if event.kind == "preemption":
        return {"preemption": event.enabled}
    scoped = event.tenant is not None or event.cache_salt is not None or event.namespace
    if not scoped:
        run.cache.switch(None, event.enabled)
        return {"prefix_caching": event.enabled, "scope": "global"}
    if event.tenant is not None:
        ns, salt = ("tenant", event.tenant), _salt(event.tenant)
    else:
        ns, salt = ("salt", event.cache_salt), event.cache_salt
    run.cache.switch(ns, event.enabled)
    answer = {"prefix_caching": event.enabled, "scope": "namespace"}
    return answer | {"namespace": run.namespace_hex(salt), "tenant": event.tenant}


def _salt(tenant: str) -> str:
    """A tenant's salt, as the server's documented rule makes it: HMAC-SHA256 of its name."""
    return hmac.new(SECRET, tenant.encode(), hashlib.sha256).hexdigest()


async def _drain(run: Run, client, event: AdminEvent, where: Where) -> None:
    admin = {"X-Admin-Token": ADMIN_TOKEN}
    response = await client.post("/admin/drain", json={"enabled": event.enabled}, headers=admin)
    health = await client.get("/health")
    run.draining = event.enabled
    state = "draining" if event.enabled else "ok"
    want = (200, {"draining": event.enabled}, 503 if event.enabled else 200)
    want += ({"status": state, "draining": event.enabled},)
    have = (response.status_code, _json(response), health.status_code, _json(health))
    if have != want:
        f = where.fields(None, "drain", want, have) | {"switches": f"drain {event.enabled}"}
        run.failures.append(failure(where, "server_admin", "drain did not switch", f))


async def _refusal(run: Run, client, event: AdminEvent, where: Where) -> None:
    """A wrong API key is a 401; a client salt on an app with keys is a 400 on `cache_salt`
    (its tenant's salt is the server's to pick)."""
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    if event.kind == "bad-key":
        headers = {"Authorization": "Bearer not-a-key"}
        want = (401, "authentication_error", None)
    else:
        headers = {"Authorization": f"Bearer {key_of(event.tenant)}"}
        body["cache_salt"] = _salt(TENANTS[0])  # another tenant's: never honoured
        want = (400, "invalid_request_error", "cache_salt")
    response = await client.post("/v1/completions", json=body, headers=headers)
    error = _json(response).get("error", {})
    have = (response.status_code, error.get("type"), error.get("param"))
    if have != want:
        f = where.fields(None, event.kind, want, have)
        f |= {"namespace": event.tenant, "prompt_tokens": 3}
        run.failures.append(failure(where, "server_tenancy", "a request was not refused", f))


__all__ = ["Expected", "StackTarget", "server_cases"]
