"""Run-time kill switches under /admin, guarded by the admin token (`X-Admin-Token`).

Layered from narrow to wide: prefix caching off for one namespace (a tenant, a cache salt, or the
unsalted namespace), prefix caching off everywhere, preemption off, and drain (refuse new requests
with 503 while running ones finish). Each switch is applied on the engine thread between two steps,
so it holds from the next scheduling decision on; each is one of the engine's own switch methods.
Cached entries stay until evicted; they are simply neither hit nor extended while caching is off.

LoRA adapters are loaded and unloaded at run time under vLLM's paths (/v1/load_lora_adapter,
/v1/unload_lora_adapter), guarded by the same token. A load under a registered name loads the
directory again: new weights are a new adapter with its own cache namespace, and requests
already queued finish with the adapter they were given."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request

from kvpage.errors import InvalidRequest
from kvpage.lora.request import LoRARequest
from kvpage.server.metrics import engine_snapshot
from kvpage.server.protocol import ApiError, LoadLoraAdapter, Switch, UnloadLoraAdapter
from kvpage.server.state import ServerState


def _state(request: Request) -> ServerState:
    return request.app.state.server


def require_admin(
    request: Request, x_admin_token: str | None = Header(default=None)
) -> ServerState:
    state = _state(request)
    token = state.options.admin_token
    if token is None:
        raise ApiError(
            "the admin API is disabled (no --admin-token)", None, 403, "permission_error"
        )
    if x_admin_token is None or not hmac.compare_digest(token, x_admin_token):
        raise ApiError("invalid or missing X-Admin-Token", None, 401, "authentication_error")
    return state


Admin = Annotated[ServerState, Depends(require_admin)]
router = APIRouter(prefix="/admin")
lora_router = APIRouter(prefix="/v1")


@router.post("/prefix-caching")
async def prefix_caching(switch: Switch, state: Admin) -> dict:
    scoped = switch.tenant is not None or switch.cache_salt is not None or switch.namespace
    engine = state.loop.engine
    if not scoped:
        await state.loop.call(engine.set_prefix_caching, switch.enabled)
        return _switched(state, {"prefix_caching": switch.enabled, "scope": "global"})
    salt = _salt(state, switch)
    await state.loop.call(engine.set_namespace_caching, salt, switch.enabled)
    digest = state.loop.engine.namespace.with_salt(salt).digest().hex()
    result = {"prefix_caching": switch.enabled, "scope": "namespace", "namespace": digest}
    return _switched(state, {**result, "tenant": switch.tenant})


@router.post("/preemption")
async def preemption(switch: Switch, state: Admin) -> dict:
    await state.loop.call(state.loop.engine.set_preemption, switch.enabled)
    return _switched(state, {"preemption": switch.enabled})


@router.post("/drain")
async def drain(switch: Switch, state: Admin) -> dict:
    state.draining = switch.enabled
    return _switched(state, {"draining": state.draining})


def _switched(state: ServerState, change: dict) -> dict:
    """Every switch change is an audit line (never sampled out): who turned what, when."""
    state.audit.write("admin_switch", always=True, **change)
    return change


@router.get("/stats")
async def stats(state: Admin) -> dict:
    snapshot = await state.loop.call(engine_snapshot, state.loop.engine)
    return {**snapshot, "draining": state.draining, "shadow_checks": state.shadow.checked}


@router.get("/audit")
async def audit(state: Admin) -> dict:
    return {"events": list(state.audit.recent)}


@lora_router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapter, state: Admin) -> dict:
    return await load_adapter(state, body.lora_name, body.lora_path)


@lora_router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapter, state: Admin) -> dict:
    return await unload_adapter(state, body.lora_name)


async def load_adapter(state: ServerState, name: str, path: str) -> dict:
    """What /v1/load_lora_adapter does once the token is checked; a Ray replica starting late
    replays the application's run-time loads through it, so they are validated alike."""
    engine = state.loop.engine
    lora = LoRARequest(name, path)
    try:
        adapter = await state.loop.call(engine.load_lora_adapter, lora, True)
    except InvalidRequest as err:
        raise ApiError(str(err), "lora_path") from err
    change = {"lora_name": adapter.name, "loaded": True, "digest": adapter.digest}
    state.audit.write("lora_adapter", always=True, **change, path=adapter.path)
    return change


async def unload_adapter(state: ServerState, name: str) -> dict:
    """What /v1/unload_lora_adapter does once the token is checked (see load_adapter)."""
    engine = state.loop.engine
    try:
        await state.loop.call(engine.unload_lora_adapter, name)
    except InvalidRequest as err:
        raise ApiError(str(err), "lora_name", 404, "not_found_error") from err
    state.audit.write("lora_adapter", always=True, lora_name=name, loaded=False)
    return {"lora_name": name, "loaded": False}


def _salt(state: ServerState, switch: Switch) -> str | None:
    if switch.tenant is not None:
        if switch.tenant not in state.tenants.keys.values():
            raise ApiError(f"unknown tenant {switch.tenant!r}", "tenant")
        return state.tenants.salt_for(switch.tenant)
    return switch.cache_salt
