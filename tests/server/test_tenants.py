"""Tenant isolation: with API keys the cache salt comes from the tenant, so tenant A's prompt
never hits tenant B's cache while two requests of A share; a client cannot pick a salt. Without
keys an explicit `cache_salt` is honoured."""

from __future__ import annotations

import openai
import pytest

from .conftest import MODEL


def _cached(server, prompt: str, key: str | None = None, **extra) -> int:
    r = server.client(key).completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra or None
    )
    return r.usage.prompt_tokens_details.cached_tokens


def test_tenants_do_not_share_prefixes(tenant_server):
    prompt = "Tenant isolation: this forty-eight byte prompt is secret."  # 3+ full blocks
    hits = tenant_server.metrics()["kvpage_prefix_cache_hits_tokens_total"]
    assert _cached(tenant_server, prompt, "key-alice") == 0
    assert _cached(tenant_server, prompt, "key-bob") == 0  # same text, other tenant: a miss
    assert tenant_server.metrics()["kvpage_prefix_cache_hits_tokens_total"] == hits
    assert _cached(tenant_server, prompt, "key-alice") == 48  # alice's own second request hits
    assert _cached(tenant_server, prompt, "key-bob") == 48
    audit = tenant_server.admin("audit")["events"]
    hit_namespaces = {e["namespace"] for e in audit if e["event"] == "prefix_hit"}
    assert len(hit_namespaces) >= 2  # one namespace per tenant


def test_api_key_required(tenant_server):
    with pytest.raises(openai.AuthenticationError):
        tenant_server.client("wrong-key").completions.create(model=MODEL, prompt="x", max_tokens=1)
    r = tenant_server.post("/v1/completions", {"prompt": "x"}, key="nope")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_client_cannot_choose_a_salt(tenant_server):
    r = tenant_server.post("/v1/completions", {"prompt": "x", "cache_salt": "alice"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_open_server_honours_cache_salt(open_server):
    prompt = "Open server, salted prompt: forty-eight bytes ok"
    assert _cached(open_server, prompt, cache_salt="s1") == 0
    assert _cached(open_server, prompt, cache_salt="s2") == 0
    assert _cached(open_server, prompt) == 0  # unsalted is a namespace of its own
    assert _cached(open_server, prompt, cache_salt="s1") == 48
