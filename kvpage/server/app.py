"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics, and the /admin switches.

`create_app(engine, options)` builds it around an engine the app then owns: the engine loop and the
shadow worker start and stop with the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace

from fastapi import APIRouter, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

import kvpage.server.admin as admin
import kvpage.server.openapi as openapi
from kvpage.engine.engine import LLMEngine
from kvpage.errors import InvalidRequest
from kvpage.lora.request import LoRARequest
from kvpage.model.tokenizer import encode_text, text_tokenizer
from kvpage.server.audit import AuditLog, audit_observer
from kvpage.server.batch import (
    MAX_PROMPTS,
    batch_body,
    batch_events,
    deltas_of_all,
    submit_all,
)
from kvpage.server.chat import Conversation, load_chat_template
from kvpage.server.engine_loop import EngineFailure, EngineLoop
from kvpage.server.generation import Generation, run, submit
from kvpage.server.metrics import ServerMetrics, engine_snapshot
from kvpage.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    error_response,
    invalid_request,
    sampling_params,
    validation_error,
)
from kvpage.server.responses import (
    chunk_body,
    echo_of,
    final_body,
    new_shape,
    role_chunk,
    sse,
    token_text,
    usage_chunk,
)
from kvpage.server.shadow import ShadowChecker
from kvpage.server.state import ServerOptions, ServerState
from kvpage.server.structured import (
    Constraint,
    is_constraint_error,
    refusal,
    request_constraint,
)
from kvpage.server.tenants import Tenants
from kvpage.server.tool_calls import ToolPolicy, finish_of, tool_policy
from kvpage.server.transport import RequestGuard

log = logging.getLogger("kvpage.server")


def create_app(engine: LLMEngine, options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions(model_name=engine.config.model)
    audit = AuditLog(options.audit_log, options.audit_sample_rate, options.seed, options.replica)
    shadow = ShadowChecker(
        engine.model,
        audit,
        options.shadow_rate,
        options.seed,
        kv_cache_dtype=engine.config.kv_cache_dtype,
        model_name=engine.config.model,
    )
    state = ServerState(
        options=options,
        loop=EngineLoop(engine),
        metrics=ServerMetrics(shadow.counts),
        audit=audit,
        tenants=_tenants(options),
        shadow=shadow,
        chat_template=load_chat_template(engine.config.model, options.chat_template),
    )
    for name, path in options.lora_modules:
        engine.load_lora_adapter(LoRARequest(name, path))
    engine.add_observer(audit_observer(audit, engine.speculation is not None))
    engine.add_observer(state.metrics)
    app = FastAPI(title="kvpage", lifespan=_lifespan)
    app.state.server = state
    app.include_router(admin.router)
    app.include_router(admin.lora_router)
    app.include_router(_routes())
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _api_error)
    app.add_middleware(RequestGuard, state=state)  # auth and body size before any parsing
    openapi.install(app)
    return app


def _tenants(options: ServerOptions) -> Tenants:
    if options.tenant_secret is None:
        return Tenants(dict(options.api_keys))
    return Tenants(dict(options.api_keys), options.tenant_secret)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (no such route, wrong method, unreadable body) in OpenAI's shape."""
    where = f"{request.method} {request.url.path}"
    message = {404: f"Invalid URL ({where})", 405: f"Method not allowed ({where})"}
    text = message.get(exc.status_code) or _parse_failure(exc) or f"{exc.detail} ({where})"
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    err = ApiError(text, None, exc.status_code, kind)
    _count(request, err.status)
    return error_response(err, exc.headers)


def _parse_failure(exc: HTTPException) -> str | None:
    """What failed when FastAPI could not parse a body (it says only "There was an error parsing
    the body"; the parser's own exception is the cause)."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None:
        return None
    if isinstance(cause, RecursionError):
        return "the request body nests too deeply to parse (arrays or objects inside each other)"
    if isinstance(cause, UnicodeDecodeError):
        bad = cause.object[cause.start : cause.start + 1].hex()
        return f"the request body is not valid UTF-8 (byte 0x{bad} at offset {cause.start})"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        limit = sys.get_int_max_str_digits()
        return f"a number in the request body has too many digits (more than {limit})"
    return f"the request body could not be parsed: {type(cause).__name__}: {cause}"


def _count(request: Request, status: int) -> None:
    """By the matched route's template (`/v1/models/{model_id:path}`), else `other`: any path can
    be asked for, and each must not become a new metrics label."""
    path = getattr(request.scope.get("route"), "path", "other")
    request.app.state.server.metrics.requests.labels(path, str(status)).inc()


async def _api_error(request: Request, exc: Exception) -> Response:
    """Every error leaves in OpenAI's shape and is counted by path and status."""
    if isinstance(exc, RequestValidationError):
        exc = validation_error(exc)
    elif not isinstance(exc, ApiError):
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        exc = ApiError(f"internal error: {type(exc).__name__}", None, 500)
    _count(request, exc.status)
    return error_response(exc)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    state.loop.start()
    state.shadow.start()
    try:
        yield
    finally:
        state.loop.stop()
        state.shadow.stop()
        state.audit.close()


def _routes() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/metrics", metrics, methods=["GET"])
    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", model_card, methods=["GET"])
    router.add_api_route("/v1/completions", completions, methods=["POST"])
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/tokenize", tokenize, methods=["POST"])
    router.add_api_route("/detokenize", detokenize, methods=["POST"])
    return router


# --- plain endpoints -------------------------------------------------------------------------
async def health(request: Request) -> Response:
    """503 while draining (admin switch or shutdown), so a load balancer stops sending here."""
    draining = request.app.state.server.draining
    body = {"status": "draining" if draining else "ok", "draining": draining}
    return JSONResponse(body, status_code=503 if draining else 200)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    stats = await state.loop.call(engine_snapshot, state.loop.engine)
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request, authorization: str | None = Header(default=None)) -> dict:
    state: ServerState = request.app.state.server
    state.tenants.authenticate(authorization)
    return {"object": "list", "data": [_card(state, name) for name in state.model_names]}


async def model_card(
    model_id: str, request: Request, authorization: str | None = Header(default=None)
) -> dict:
    state: ServerState = request.app.state.server
    state.tenants.authenticate(authorization)
    if model_id not in state.model_names:
        message = f"The model {model_id!r} does not exist"
        raise ApiError(message, "model", 404, "not_found_error")
    return _card(state, model_id)


def _card(state: ServerState, name: str) -> dict:
    card = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "kvpage",
        "root": state.loop.engine.config.model,
        "max_model_len": state.loop.engine.max_model_len,
    }
    adapter = state.adapter_for(name)
    if adapter is not None:  # vLLM's card of an adapter: its directory, the base as parent
        card.update(root=adapter.lora_path, parent=state.base_names[0])
    return card


# --- tokenizer endpoints (vLLM's shapes) -----------------------------------------------------
async def tokenize(
    body: TokenizeRequest, request: Request, authorization: str | None = Header(default=None)
) -> dict:
    state = _check_model(request, body.model, authorization)
    body.check()
    if body.messages is not None:
        specials = body.add_special_tokens
        if specials is None:  # as chat does: a model's own template spells its specials
            specials = state.chat_template.builtin
        ids = _encode(state, _render(state, body), add_special_tokens=specials)
    else:
        if body.chat_template is not None:  # unused with a prompt, but a name the model has
            state.chat_template.select(body.chat_template, body.tools)
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = _encode(state, body.prompt, add_special_tokens=add)
    engine = state.loop.engine
    strs = [token_text(engine.tokenizer, t) for t in ids] if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": engine.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


async def detokenize(
    body: DetokenizeRequest, request: Request, authorization: str | None = Header(default=None)
) -> dict:
    state = _check_model(request, body.model, authorization)
    engine = state.loop.engine
    vocab = engine.model.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
    if engine.tokenizer is None:
        raise ApiError(f"{engine.config.model} has no tokenizer to decode with", "tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens)}


def _check_model(request: Request, model: str, authorization: str | None) -> ServerState:
    state: ServerState = request.app.state.server
    request.state.tenant = state.tenants.authenticate(authorization)
    if model and model not in state.model_names:
        raise ApiError(f"model {model!r} is not served here", "model", 404, "not_found_error")
    return state


# --- generation endpoints --------------------------------------------------------------------
async def completions(
    body: CompletionRequest, request: Request, authorization: str | None = Header(default=None)
) -> Response:
    state = _admit(request, body, authorization)
    constraint = request_constraint(body)
    prompts = body.prompts()
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    all_ids = [_encode(state, p) if isinstance(p, str) else list(p) for p in prompts]
    if len(all_ids) > 1:
        return await _serve_batch(request, state, body, all_ids, constraint)
    prompt_ids = all_ids[0]
    max_tokens = _room(state, prompt_ids) if body.max_tokens is None else body.max_tokens
    return await _serve(
        request, state, body, prompt_ids, max_tokens, body.logprobs, False, constraint
    )


async def _serve_batch(
    request, state, body, all_ids: list[list[int]], constraint: Constraint | None
) -> Response:
    """A list of prompts: one engine request each (kvpage.server.batch)."""
    salt = state.tenants.cache_salt(request.state.tenant, body.cache_salt)
    shape = new_shape(
        False,
        _served_name(state, body.model),
        body.logprobs,
        body.return_token_ids,
        body.include_usage,
        body.echo,
        body.prompt_logprobs,
        body.return_tokens_as_token_ids,
    )
    tokenizer = text_tokenizer(state.loop.engine.tokenizer, body.skip_special_tokens is not False)
    gens = []
    for i, ids in enumerate(all_ids):
        max_tokens = _room(state, ids) if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, body.logprobs, _params(constraint))
        rid = f"{shape.request_id}-{i}"
        gen = Generation.new(
            rid, ids, params, salt, tokenizer, body.stop_strings, state.text_stream
        )
        gen.echo_only = max_tokens == 0
        gen.lora = state.adapter_for(body.model)
        gens.append(gen)
    sinks = await submit_all(state, gens, request.state.tenant, constraint)
    path = request.url.path
    if body.stream:
        return StreamingResponse(
            _counted(batch_events(state, shape, gens, sinks), state, path),
            media_type="text/event-stream",
        )
    response = await _complete_batch(request, state, shape, gens, sinks)
    state.metrics.requests.labels(path, str(response.status_code)).inc()
    return response


async def _counted(events: AsyncIterator[str], state, path: str) -> AsyncIterator[str]:
    status = "499"
    try:
        async for event in events:
            yield event
        status = "200"
    finally:
        state.metrics.requests.labels(path, status).inc()


async def _complete_batch(request, state, shape, gens, sinks) -> Response:
    if await _collected_unless_gone(request, deltas_of_all(state, gens, sinks)):
        return JSONResponse(batch_body(shape, gens, state.loop.engine.tokenizer))
    return Response(status_code=499)  # every prompt's run aborts its request on the way out


async def chat_completions(
    body: ChatCompletionRequest, request: Request, authorization: str | None = Header(default=None)
) -> Response:
    state = _admit(request, body, authorization)
    tools = tool_policy(body, state.options.auto_tool_parser)
    constraint = request_constraint(body, tools.constraint)
    # A model's own (Jinja) template spells BOS and the other specials itself; encoding its text
    # with special tokens would add them twice. The built-in template has none.
    specials = state.chat_template.builtin
    prompt_ids = _encode(state, _render(state, body), add_special_tokens=specials)
    max_tokens = body.max_completion_tokens or body.max_tokens or _room(state, prompt_ids)
    return await _serve(
        request, state, body, prompt_ids, max_tokens, body.num_logprobs, True, constraint, tools
    )


def _render(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> str:
    """The request's chat as the template writes it (a template's refusal is a 400)."""
    return state.chat_template.render(Conversation.of(body))


def _admit(request: Request, body, authorization: str | None) -> ServerState:
    """Checks that need no engine: auth, drain, model name, unsupported fields."""
    state: ServerState = request.app.state.server
    request.state.tenant = state.tenants.authenticate(authorization)
    if (refusal := state.refusal()) is not None:
        raise refusal
    if body.model and body.model not in state.model_names:
        raise ApiError(f"model {body.model!r} is not served here", "model", 404, "not_found_error")
    body.check_unsupported()
    return state


def _served_name(state: ServerState, model: str) -> str:
    """What responses name as their model: the adapter asked for, else the base model."""
    return model if state.adapter_for(model) is not None else state.options.model_name


def _encode(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    engine = state.loop.engine
    try:
        if not add_special_tokens and engine.tokenizer is not None:
            return engine.tokenizer.encode(text, add_special_tokens=False)
        return encode_text(engine.tokenizer, text, engine.config.model)
    except InvalidRequest as err:
        raise ApiError(str(err), "prompt") from err


def _room(state: ServerState, prompt_ids: list[int]) -> int:
    """Default max_tokens: whatever the context and the KV pool leave after the prompt."""
    engine = state.loop.engine
    pool_tokens = engine.cache.pool.num_blocks * engine.config.block_size
    return max(1, min(engine.max_model_len, pool_tokens) - len(prompt_ids))


def _params(constraint: Constraint | None):
    return None if constraint is None else constraint.params


async def _serve(
    request,
    state,
    body,
    prompt_ids,
    max_tokens,
    num_logprobs,
    chat: bool,
    constraint: Constraint | None = None,
    tools: ToolPolicy | None = None,
) -> Response:
    # max_tokens 0 (echo only): the engine scores the prompt and draws nothing, so a prompt
    # may fill the whole context.
    params = sampling_params(body, max_tokens, num_logprobs, _params(constraint))
    salt = state.tenants.cache_salt(request.state.tenant, body.cache_salt)
    model = _served_name(state, body.model)
    echo = not chat and body.echo
    shape = new_shape(
        chat,
        model,
        num_logprobs,
        body.return_token_ids,
        body.include_usage,
        echo,
        body.prompt_logprobs,
        body.return_tokens_as_token_ids,
    )
    if tools is not None and tools.parses:
        shape = replace(shape, tools=tools)
    tokenizer = text_tokenizer(state.loop.engine.tokenizer, body.skip_special_tokens is not False)
    stop = body.stop_strings
    gen = Generation.new(
        shape.request_id, prompt_ids, params, salt, tokenizer, stop, state.text_stream
    )
    gen.echo_only = max_tokens == 0
    gen.lora = state.adapter_for(body.model)
    adapter = None if gen.lora is None else gen.lora.lora_name
    state.audit.admit(gen.request_id, request.state.tenant, adapter)
    try:
        sink = await submit(state, gen)
    except InvalidRequest as err:
        state.audit.forget(gen.request_id)
        if constraint is not None and is_constraint_error(err):
            raise refusal(err, constraint) from err
        raise _named_as_sent(invalid_request(err), body, chat) from err
    if body.stream:
        events = _stream(state, shape, gen, sink, body.include_usage, request.url.path)
        return StreamingResponse(events, media_type="text/event-stream")
    response = await _complete(request, state, shape, gen, sink)
    state.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
    return response


def _named_as_sent(err: ApiError, body, chat: bool) -> ApiError:
    """The engine names its limit max_tokens; a chat request that sent max_completion_tokens
    is told about the field it sent."""
    if chat and err.param == "max_tokens" and body.max_completion_tokens is not None:
        message = err.message.replace("max_tokens", "max_completion_tokens", 1)
        return ApiError(message, "max_completion_tokens")
    return err


async def _stream(state, shape, gen, sink, include_usage: bool, path: str) -> AsyncIterator[str]:
    """The SSE body; counted 200 only once the client has had it all (499 if it left first)."""
    status = "499"
    try:
        async for event in _stream_events(state, shape, gen, sink, include_usage):
            yield event
        status = "200"
    finally:
        state.metrics.requests.labels(path, status).inc()


async def _stream_events(state, shape, gen, sink, include_usage: bool) -> AsyncIterator[str]:
    tokenizer = state.loop.engine.tokenizer
    quiet = shape.num_logprobs is None and not shape.return_token_ids
    if shape.chat:
        for index in range(len(gen.choices)):
            yield sse(role_chunk(shape, index))
    started: set[int] = set()  # choices that have had a chunk (the first carries the echo)
    echo = None  # made at the first delta: the prompt's logprobs come with the first output
    calls = {c.index: shape.tools.stream() for c in gen.choices} if shape.tools else {}
    try:
        async with aclosing(run(state, gen, sink)) as deltas:
            async for delta in deltas:
                first = delta.index not in started
                said = delta.text
                if calls:  # the text read as tool calls (kvpage.server.tool_calls)
                    stream = calls[delta.index]
                    said = stream.feed(delta.text, delta.finish_reason is not None)
                    delta.finish_reason = finish_of(delta.finish_reason, stream.called)
                if first or said or delta.finish_reason is not None or not quiet:
                    started.add(delta.index)
                    if shape.echo and echo is None:
                        echo = echo_of(gen, tokenizer, shape.num_logprobs is not None)
                    chunk = chunk_body(shape, delta, tokenizer, echo, first, gen)
                    if calls:
                        chunk["choices"][0]["delta"] = said
                    yield sse(chunk)
    except EngineFailure as err:
        yield sse(error_body(str(err), err.kind))
    if include_usage:
        yield sse(usage_chunk(shape, gen))
    yield sse("[DONE]")


async def _complete(request, state, shape, gen, sink) -> Response:
    """Collect the whole response; a client that hangs up meanwhile aborts the request."""
    if await _collected_unless_gone(request, run(state, gen, sink)):
        return JSONResponse(final_body(shape, gen, state.loop.engine.tokenizer))
    return Response(status_code=499)  # run() aborts the request on its way out


async def _collected_unless_gone(request: Request, deltas) -> bool:
    """Drain `deltas` (an async generator of a request's deltas); False if the client hung up
    first (the generator is cancelled, and its runs abort their requests on the way out)."""

    async def collect() -> None:
        async with aclosing(deltas) as running:
            async for _ in running:
                pass

    task = asyncio.create_task(collect())
    gone = asyncio.create_task(_disconnected(request))
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not task.done():
        task.cancel()
        return False
    try:
        task.result()
    except EngineFailure as err:
        raise ApiError(str(err), None, err.status, err.kind) from err
    return True


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
