"""`kvpage serve --replicas N`: N engine replicas on Ray Serve behind one ingress.

    HTTP -> Ray Serve proxy -> Ingress (1 replica: routing key, /metrics, /health)
         -> KVPageRequestRouter (in the ingress process: prefix | round-robin | least-loaded)
         -> EngineReplica x N (each a whole single-process kvpage app: engine, audit, metrics)

A replica runs the single server's own app on each request (`asgi_call`), so the API, its errors
and its streaming are those of `kvpage serve` by construction. Every replica is built from the
same ReplicaSpec, tenant secret included: a tenant's cache salt is the same on all of them, and
a replica Ray starts to replace a dead one gets it too.

LoRA adapters loaded at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter) go to every
live replica; what they all accepted is kept in the application's record (a detached Ray actor:
kvpage.serve_replicas.adapter_record says why there), which a replica started later replays
before it reports ready. Each replica reports the adapters it holds, and the router sends a
request for an adapter only to a replica that holds it; with none, the ingress answers it
(404 or 503 naming the adapter) instead of sending it anywhere.

Importing this module imports Ray; nothing else in kvpage does."""

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from kvpage.config import EngineConfig
from kvpage.serve_replicas.adapter_holdings import BASE, Holdings
from kvpage.serve_replicas.adapter_record import RecordClient, drop_record
from kvpage.serve_replicas.asgi_call import HttpCall, ResponseStart, call_asgi
from kvpage.serve_replicas.metrics_merge import merge
from kvpage.serve_replicas.prefix_router import RouterConfig
from kvpage.serve_replicas.ray_router import ROUTERS, KVPageRequestRouter
from kvpage.serve_replicas.routing_key import UNROUTED, RoutingKeys
from kvpage.server.protocol import ApiError, error_body
from kvpage.server.responses import sse
from kvpage.server.state import ServerOptions

log = logging.getLogger("kvpage.serve_replicas")

APP_NAME = "kvpage"
ENGINE_DEPLOYMENT = "EngineReplica"
REPLICA_HEADER = "x-kvpage-replica"
_FAN_OUT_TIMEOUT_S = 30.0  # a replica that does not answer a /metrics broadcast is left out
# Calls every replica must hear: an adapter loaded on one replica only would be a 404 whenever
# the router sends its requests elsewhere.
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
EVERY_REPLICA = frozenset({("POST", LOAD), ("POST", UNLOAD)})
_CONTROL_TIMEOUT_S = 120.0  # a load reads the adapter's weights on every replica
_REPLAY_ROUNDS = 3  # a starting replica reads the adapter record again if it changed meanwhile
# Ray's own telemetry would try to reach the network; the dashboard is not needed to serve.
# Set before Ray starts (its processes inherit them). Quiet: no usage stats, no Docker warning.
# Patient: Ray Serve gives its HTTP proxy 5 s to answer a ready check and 10 s a health check,
# then kills it; on a 2-core machine with both cores busy the proxy's fresh process takes
# longer than that, and the service never comes up.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "120",
}


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What every replica is built from; the same object for all, so the same tenant salts."""

    engine: EngineConfig
    options: ServerOptions
    cpus: float = 1.0  # Ray CPUs per replica; also its torch threads


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    replica: ReplicaSpec
    replicas: int = 2
    router: RouterConfig = field(default_factory=RouterConfig)
    max_ongoing_requests: int = 256  # per replica; the engine's scheduler queues beyond its batch


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    replica: str
    actor_name: str  # for ray.get_actor(..., namespace="serve")
    requests: int  # running + waiting + swapped
    leaked_blocks: int  # private or shared blocks held while no request runs (must be 0)
    invariants: str  # "ok" or the violation
    stats: dict[str, int]
    salt_digests: dict[str, str]  # tenant -> SHA-256 of its cache salt (equal on every replica)


class EngineReplica:
    async def __init__(self, spec: ReplicaSpec) -> None:
        """Ray Serve awaits it: the replica reports ready (and is routed to) only after the
        application's run-time adapters are loaded here."""
        import torch

        from kvpage.engine.engine import LLMEngine
        from kvpage.server import create_app

        torch.set_num_threads(max(1, int(spec.cpus)))  # replicas share the machine's cores
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.actor_name = context.replica_id.to_full_id_str()
        options = replace(spec.options, replica=self.name)
        self.app = create_app(LLMEngine(spec.engine), options)
        self.state = self.app.state.server
        # adapter -> why its start-up load failed; the engine thread reads it (_snapshot)
        self.failed: dict[str, str] = {}
        self.seq = 0  # holdings snapshots taken (on the engine thread only)
        self.state.loop.start()
        self.state.shadow.start()
        await self._replay(RecordClient(context.app_name))

    async def _replay(self, record: RecordClient) -> None:
        """The application's run-time loads and unloads, in their order, through the admin
        path a live load takes (same validation, same audit line). A load that fails here is
        not fatal: the replica serves the rest, its holdings leave the adapter out (so the
        router never sends it that adapter's requests) and name it under `failed`, which the
        ingress's /health reports."""
        applied: list[tuple[str, str | None]] = []
        for _ in range(_REPLAY_ROUNDS):  # again while the record changes under the replay
            entries = await record.call("entries")
            todo = [entry for entry in entries if entry not in applied]
            if not todo:
                return
            for name, path in todo:
                await self._apply(name, path)
            applied = entries

    async def _apply(self, name: str, path: str | None) -> None:
        from kvpage.server.admin import load_adapter, unload_adapter

        try:
            if path is not None:
                await load_adapter(self.state, name, path)
            elif name in await self.state.loop.call(lambda: self.state.adapter_names):
                await unload_adapter(self.state, name)
        except ApiError as err:
            self.failed = {**self.failed, name: err.message}  # replaced, never mutated
            log.error("replica %s: adapter %r not loaded at start: %s", self.name, name, err)

    async def http(self, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
        async for piece in call_asgi(self.app, call, self.name):
            yield piece

    async def control(self, call: HttpCall) -> tuple[str, int, bytes, Holdings]:
        """(replica, status, body, holdings after it) of one whole reply, for the ingress's
        fan-out of the calls every replica must hear."""
        pieces = [p async for p in call_asgi(self.app, call, self.name)]
        body = b"".join(p for p in pieces[1:] if isinstance(p, bytes))
        name, status = _json_object(call.body).get("lora_name"), pieces[0].status
        if call.path == UNLOAD and status in (200, 404):  # unloaded by choice: not a failure
            self.failed = {n: why for n, why in self.failed.items() if n != name}
        return self.name, status, body, await self._holdings()

    async def holdings(self) -> tuple[str, Holdings]:
        """(replica, the adapters it holds now), for the ingress's refresh."""
        return self.name, await self._holdings()

    async def record_routing_stats(self) -> dict:
        """Ray pulls it periodically and hands it to the router with the replica list."""
        return (await self._holdings()).to_stats()

    async def _holdings(self) -> Holdings:
        return await self.state.loop.call(self._snapshot)

    def _snapshot(self) -> Holdings:  # on the engine thread: serialised with loads and unloads
        self.seq += 1
        held = frozenset(self.state.adapter_names)
        failed = tuple(sorted((n, why) for n, why in self.failed.items() if n not in held))
        return Holdings(self.seq, held, failed)

    async def metrics_text(self) -> tuple[str, str]:
        """(replica, its /metrics exposition), for the ingress's merged /metrics."""
        call = HttpCall("GET", "/metrics", b"", [], b"", UNROUTED)
        chunks = [p async for p in call_asgi(self.app, call, self.name) if isinstance(p, bytes)]
        return self.name, b"".join(chunks).decode()

    async def report(self) -> ReplicaReport:
        """Pool accounting for tests and operators: leaks show once the replica is idle."""
        return await self.state.loop.call(self._report)

    def _report(self) -> ReplicaReport:  # on the engine thread, between steps
        engine = self.state.loop.engine
        stats = engine.stats()
        requests = stats["running"] + stats["waiting"] + stats["swapped"]
        held = stats["private_blocks"] + stats["shared_blocks"]
        try:
            engine.cache.check_invariants()
            invariants = "ok"
        except Exception as err:  # reported, not raised: the caller asked for a diagnosis
            invariants = f"{type(err).__name__}: {err}"
        leaked = held if requests == 0 else 0
        tenants = self.state.tenants
        salts = {t: _digest(tenants.salt_for(t)) for t in sorted(set(tenants.keys.values()))}
        return ReplicaReport(self.name, self.actor_name, requests, leaked, invariants, stats, salts)

    def __del__(self) -> None:  # Ray Serve calls it when the replica is shut down
        state = getattr(self, "state", None)
        if state is not None:
            state.loop.stop()
            state.shadow.stop()
            state.audit.close()


def _digest(salt: str) -> str:
    return hashlib.sha256(salt.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class IngressSpec:
    model: str
    api_keys: dict[str, str]
    max_body_bytes: int
    body_read_timeout: float = 30.0  # the replica's: a body that takes longer is a 408
    base_names: tuple[str, ...] = ()  # the base model's names; any other `model` is an adapter
    chat_template: str | None = None  # --chat-template's text: the replicas render with it too


api = FastAPI(title="kvpage (Ray Serve)")


class IngressCore:
    """The ingress's logic. `Ingress` below is Ray's ASGI wrapper of it: Ray ships that wrapper
    by value, so the logic stays here, importable, and module state (the router registry) is
    this process's, not a pickled copy."""

    def __init__(self, engines: DeploymentHandle, spec: IngressSpec) -> None:
        from kvpage.model import load_tokenizer
        from kvpage.server.chat import load_chat_template
        from kvpage.server.tenants import Tenants

        self.engines = engines
        self.spec = spec
        self.app_name = serve.get_replica_context().app_name
        self.record = RecordClient(self.app_name)
        self._refreshing: asyncio.Task | None = None  # a background ask for replicas' adapters
        tokenizer = load_tokenizer(spec.model)
        self.keys = RoutingKeys(
            Tenants(dict(spec.api_keys)),
            tokenizer,
            load_chat_template(spec.model, spec.chat_template),
            frozenset(spec.base_names),
        )

    @api.get("/health")
    async def health(self) -> Response:
        router = await self._router()
        replicas = router.replica_ids() if router is not None else []
        ok = bool(replicas)
        body = {"status": "ok" if ok else "no replicas", "draining": False, "replicas": replicas}
        failures = {r: f for r, f in router.router.holdings.failures().items() if r in replicas}
        if ok and failures:  # served, but some replica lacks an adapter it should hold
            body.update(status="degraded", adapter_failures=failures)
        return JSONResponse(body, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        router = await self._router()
        if router is None:
            return _error(503, "no engine replica is running")
        # Ray's broadcast reaches every live replica without the router; one that fails or
        # does not answer in time is left out, the others still report.
        try:
            replies = await self.engines.broadcast("metrics_text").results_async(
                timeout_s=_FAN_OUT_TIMEOUT_S, return_exceptions=True
            )
        except TimeoutError:
            return _error(503, f"replicas did not report within {_FAN_OUT_TIMEOUT_S:g} s")
        merged = merge(dict(r for r in replies if isinstance(r, tuple)))
        return Response(merged + _router_metrics(router), media_type="text/plain; version=0.0.4")

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(self, path: str, request: Request) -> Response:
        try:
            async with asyncio.timeout(self.spec.body_read_timeout):
                body = await request.body()
        except TimeoutError:
            timeout = self.spec.body_read_timeout
            return _error(408, f"the request body did not arrive within {timeout:g} s")
        if len(body) > self.spec.max_body_bytes:  # the replica would say 413; spare the trip
            return _error(413, f"request body larger than {self.spec.max_body_bytes} bytes")
        path = "/" + path  # relative to this application's route prefix
        key = self.keys.key(path, request.headers.get("authorization"), body)
        query, headers = request.url.query.encode(), list(request.headers.raw)
        call = HttpCall(request.method, path, query, headers, body, key)
        if (request.method, path) in EVERY_REPLICA:
            return await self._to_every_replica(call)
        if call.key.adapter != BASE and (refusal := await self._unheld(call.key.adapter)):
            return refusal
        return await self._send(call)

    async def _to_every_replica(self, call: HttpCall) -> Response:
        """`call` to every live replica: their common reply when all agree, else 502 naming
        what each replica answered (the change then holds on some replicas only). Each
        replica's adapters after the call go to the router at once; what they all accepted
        goes to the application's record (kvpage.serve_replicas.adapter_record)."""
        try:
            replies = await self.engines.broadcast("control", call).results_async(
                timeout_s=_CONTROL_TIMEOUT_S, return_exceptions=True
            )
        except TimeoutError:
            return _error(503, f"replicas did not answer within {_CONTROL_TIMEOUT_S:g} s")
        answered = sorted((r for r in replies if isinstance(r, tuple)), key=lambda r: r[0])
        if not answered:
            return _error(503, "no engine replica is running")
        if (router := self._registered()) is not None:
            for name, _, _, holdings in answered:
                router.report(name, holdings)
        statuses = {status for _, status, _, _ in answered}
        if call.path == UNLOAD and statuses == {200, 404}:  # 404: did not hold it; gone all over
            statuses = {200}
        everyone = len(answered) == len(replies)
        if not await self._record(call, statuses, everyone):
            return _error(
                503,
                "the change holds on every live replica but was not recorded "
                "(the adapter record is unreachable): a replica started later lacks it",
            )
        if everyone and statuses == {200}:
            await self._catch_up(call, {name for name, _, _, _ in answered})
        names = ",".join(name for name, _, _, _ in answered)
        if len(statuses) == 1 and everyone:
            _, _, body, _ = next(r for r in answered if r[1] in statuses)
            headers = {REPLICA_HEADER: names}
            return Response(body, statuses.pop(), headers=headers, media_type="application/json")
        lost = len(replies) - len(answered)
        said = "; ".join(
            f"{name}: {status} {body.decode(errors='replace')}"
            for name, status, body, _ in answered
        )
        return _error(502, f"the replicas disagree ({lost} did not answer): {said}")

    async def _catch_up(self, call: HttpCall, answered: set[str]) -> None:
        """`call` to each replica the router lists now that the broadcast did not reach: one
        that went live during it, after its start-up read of the record (a load that does not
        reach it leaves it out of the adapter's holders: fewer holders, never a wrong one)."""
        router = self._registered()
        for replica in [] if router is None else sorted(set(router.replica_ids()) - answered):
            try:
                async with asyncio.timeout(_CONTROL_TIMEOUT_S):  # a pinned call waits for it
                    reply = await self.engines.control.remote(replace(call, pin=replica))
            except (RayError, TimeoutError) as err:
                log.warning("replica %s missed %s: %s", replica, call.path, err)
                continue
            router.report(reply[0], reply[3])

    async def _record(self, call: HttpCall, statuses: set[int], everyone: bool) -> bool:
        """A load every live replica accepted, or an unload, into the record; False if the
        record could not be reached."""
        body = _json_object(call.body)
        name, path = body.get("lora_name"), body.get("lora_path")
        try:
            if call.path == LOAD and statuses == {200} and everyone and isinstance(path, str):
                await self.record.call("loaded", name, path)
            elif call.path == UNLOAD and 200 in statuses and isinstance(name, str):
                await self.record.call("unloaded", name)
        except RayError as err:
            log.error("the adapter record of %s is unreachable: %s", self.app_name, err)
            return False
        return True

    async def _unheld(self, adapter: str) -> Response | None:
        """None when a live replica holds `adapter`; else the ingress's own answer, so the
        request never reaches a replica without it: 404 as a replica says it (the adapter was
        never loaded, or was unloaded), 503 when the application loaded it but no live replica
        holds it now (a replacement still loading it, or one whose load of it failed)."""
        router = await self._router()
        if router is None:
            return None  # no replica at all: the usual path says so
        if router.unreported():  # a replica that just started: learn what it holds
            if not router.holders(adapter):
                await self._refresh(router)  # it may be the only holder: wait for its answer
            elif self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.create_task(self._refresh(router))  # no need to wait
        if router.holders(adapter):
            return None
        try:
            recorded = adapter in await self.record.call("loaded_names")
        except RayError:
            recorded = True  # unknown: say it may come back rather than that it does not exist
        if not recorded:
            message = f"model {adapter!r} is not served here"
            return JSONResponse(error_body(message, "not_found_error", "model"), status_code=404)
        failures = router.router.holdings.failures()
        why = "; ".join(f"{r}: {f[adapter]}" for r, f in failures.items() if adapter in f)
        message = f"no live replica holds adapter {adapter!r} now" + (
            f" (its load failed on {why})" if why else " (a replica is still loading it)"
        )
        return _error(503, message)

    async def _refresh(self, router: KVPageRequestRouter) -> None:
        """Every live replica's adapters, asked now (a replica that does not answer in time is
        left as it was)."""
        try:
            replies = await self.engines.broadcast("holdings").results_async(
                timeout_s=_FAN_OUT_TIMEOUT_S, return_exceptions=True
            )
        except TimeoutError:
            return
        for reply in replies:
            if isinstance(reply, tuple):
                router.report(*reply)

    async def _send(self, call: HttpCall) -> Response:
        pieces = self.engines.options(stream=True).http.remote(call)
        try:
            start = await pieces.__anext__()
        except RayActorError:
            return _error(503, "the replica serving this request died; retry (others remain)")
        response = StreamingResponse(_rest(pieces, _is_sse(start)), status_code=start.status)
        # the replica's own headers (content type and length included), as it sent them
        response.raw_headers = [*start.headers, (REPLICA_HEADER.encode(), start.replica.encode())]
        return response

    async def _router(self) -> KVPageRequestRouter | None:
        """The router of this process's handle (the first call makes Ray create it); None if
        no replica answers within the fan-out timeout."""
        try:
            async with asyncio.timeout(_FAN_OUT_TIMEOUT_S):
                while (router := self._registered()) is None or not router.curr_replicas:
                    call = HttpCall("GET", "/health", b"", [], b"", UNROUTED)
                    async for _ in self.engines.options(stream=True).http.remote(call):
                        pass
        except (RayActorError, TimeoutError):
            return None
        return router

    def _registered(self) -> KVPageRequestRouter | None:
        return ROUTERS.get((self.app_name, ENGINE_DEPLOYMENT))


Ingress = serve.ingress(api)(IngressCore)


async def _rest(pieces, event_stream: bool = True) -> AsyncIterator[bytes]:
    """The body after the start. A replica dying mid-stream ends an SSE stream as the single
    server ends one whose engine failed: an error event, then `data: [DONE]`, so a client sees
    an ended stream, not a cut one. Any other body is cut (the connection closes short)."""
    try:
        async for piece in pieces:
            yield piece
    except Exception as err:
        if not event_stream:
            raise
        if isinstance(err, RayActorError):
            message = "the replica serving this request died mid-response; retry (others remain)"
        else:
            message = f"the replica serving this request failed mid-response: {type(err).__name__}"
        yield sse(error_body(message, "server_error")).encode()
        yield sse("[DONE]").encode()
    finally:  # the client left mid-stream: the replica sees a disconnect and aborts the request
        pieces.cancel()


def _is_sse(start: ResponseStart) -> bool:
    types = [v for k, v in start.headers if k.lower() == b"content-type"]
    return bool(types) and types[0].split(b";")[0].strip() == b"text/event-stream"


def _json_object(body: bytes) -> dict:
    try:
        parsed = json.loads(body)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return JSONResponse(error_body(message, kind), status_code=status)


def _router_metrics(router: KVPageRequestRouter) -> str:
    lines = [
        "# HELP kvpage_router_requests_total Requests routed, by replica and reason",
        "# TYPE kvpage_router_requests_total counter",
        *(
            f'kvpage_router_requests_total{{reason="{reason}",replica="{rid}"}} {n}'
            for (rid, reason), n in sorted(router.decisions.items())
        ),
        "# HELP kvpage_router_in_flight Requests routed to the replica and not yet completed",
        "# TYPE kvpage_router_in_flight gauge",
        *(
            f'kvpage_router_in_flight{{replica="{rid}"}} {router.loads[rid]}'
            for rid in router.replica_ids()
        ),
        "# HELP kvpage_router_matched_tokens_total Prompt tokens the chosen replica was sent before",
        "# TYPE kvpage_router_matched_tokens_total counter",
        *(
            f'kvpage_router_matched_tokens_total{{replica="{rid}"}} {n}'
            for rid, n in sorted(router.matched_tokens.items())
        ),
    ]
    return "\n".join(lines) + "\n"


# --- building and running the application ---------------------------------------------------
def build_app(config: ServiceConfig) -> serve.Application:
    routing = RequestRouterConfig(
        request_router_class="kvpage.serve_replicas.ray_router.KVPageRequestRouter",
        request_router_kwargs=asdict(config.router),
    )
    engines = serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        num_replicas=config.replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.replica.cpus},
        request_router_config=routing,
    )
    ingress = serve.deployment(
        Ingress,
        name="Ingress",
        num_replicas=1,
        max_ongoing_requests=100_000,  # it only forwards; the replicas bound the work
        ray_actor_options={"num_cpus": 0},
    )
    options = config.replica.options
    spec = IngressSpec(
        config.replica.engine.model,
        dict(options.api_keys),
        options.max_body_bytes,
        options.body_read_timeout,
        options.served_model_names or (options.model_name,),
        options.chat_template,
    )
    return ingress.bind(engines.bind(config.replica), spec)


def start(
    config: ServiceConfig,
    host: str,
    port: int,
    address: str | None = None,
    app_name: str = APP_NAME,
    route_prefix: str = "/",
) -> None:
    """Attach to (address) or start a local Ray, then deploy; returns once replicas are up.
    Several applications may share one Ray Serve instance under different names and prefixes."""
    for name, value in RAY_ENV.items():
        os.environ.setdefault(name, value)
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    _patient_proxy_start()
    serve.start(http_options={"host": host, "port": port})
    drop_record(app_name)  # a fresh deployment has no run-time adapters yet
    serve.run(build_app(config), name=app_name, route_prefix=route_prefix)


PROXY_START_S = 300.0


def _patient_proxy_start() -> None:
    """Ray Serve 2.60 gives its HTTP proxy actor a fixed 60 s to start (a constant of its
    private api module, no setting): on a 2-core machine with both cores busy the proxy's
    process takes longer than that, and `serve.start` gives up on a proxy that would have
    come up. Wait as long as kvpage's own readiness deadlines do."""
    from ray.serve._private import api

    api.HTTP_PROXY_TIMEOUT = max(getattr(api, "HTTP_PROXY_TIMEOUT", 0), PROXY_START_S)


def stop(app_name: str = APP_NAME) -> None:
    serve.delete(app_name)
    drop_record(app_name)
