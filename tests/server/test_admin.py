"""Run-time kill switches take effect on the next request: prefix caching off globally and
per namespace (tenant), preemption off, drain. All guarded by the admin token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from .conftest import MODEL


def _cached(server, prompt: str, key: str | None = None) -> int:
    r = server.client(key).completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0
    )
    return r.usage.prompt_tokens_details.cached_tokens


def test_admin_needs_the_token(open_server):
    url = f"{open_server.url}/admin/preemption"
    assert httpx.post(url, json={"enabled": False}).status_code == 401
    bad = {"X-Admin-Token": "guess"}
    assert httpx.post(url, json={"enabled": False}, headers=bad).status_code == 401
    assert httpx.get(f"{open_server.url}/admin/stats", headers=bad).status_code == 401


def test_global_prefix_caching_switch(open_server):
    prompt = "Global switch: a prompt of three full blocks, no more."
    _cached(open_server, prompt)
    assert _cached(open_server, prompt) == 48
    open_server.admin("prefix-caching", {"enabled": False})
    try:
        assert _cached(open_server, prompt) == 0
    finally:
        open_server.admin("prefix-caching", {"enabled": True})
    assert _cached(open_server, prompt) == 48


def test_per_tenant_prefix_caching_switch(tenant_server):
    prompt = "Namespace switch: a prompt of three full blocks, too."
    for key in ("key-alice", "key-bob"):
        _cached(tenant_server, prompt, key)
    tenant_server.admin("prefix-caching", {"enabled": False, "tenant": "alice"})
    try:
        assert _cached(tenant_server, prompt, "key-alice") == 0
        assert _cached(tenant_server, prompt, "key-bob") == 48  # other namespaces unaffected
    finally:
        tenant_server.admin("prefix-caching", {"enabled": True, "tenant": "alice"})
    assert _cached(tenant_server, prompt, "key-alice") == 48


def _burst(server, n: int = 6) -> None:
    """n concurrent requests that together need more than the 64-block pool."""
    client = server.client()

    def one(i: int) -> int:
        r = client.completions.create(
            model=MODEL,
            prompt=f"burst {i} " + "x" * 150,
            max_tokens=150,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return r.usage.completion_tokens

    with ThreadPoolExecutor(n) as pool:
        assert list(pool.map(one, range(n), timeout=120)) == [150] * n


def test_preemption_switch(open_server):
    open_server.admin("preemption", {"enabled": False})
    try:
        before = open_server.wait_idle()["preemptions"]
        _burst(open_server)
        assert open_server.wait_idle()["preemptions"] == before
    finally:
        open_server.admin("preemption", {"enabled": True})
    _burst(open_server)
    assert open_server.wait_idle()["preemptions"] > before


def test_drain(open_server):
    client = open_server.client()
    stream = client.completions.create(
        model=MODEL,
        prompt="draining",
        max_tokens=30,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    open_server.admin("drain", {"enabled": True})
    try:
        r = open_server.post("/v1/completions", {"prompt": "too late", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"
        rest = list(stream)  # the running request still finishes
        assert rest[-1].choices[0].finish_reason == "length"
        assert len(first.choices) == 1
    finally:
        open_server.admin("drain", {"enabled": False})
    assert open_server.post("/v1/completions", {"prompt": "back", "max_tokens": 2}).is_success
