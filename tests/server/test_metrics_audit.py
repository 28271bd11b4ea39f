"""Observability: token counters, an end-to-end latency histogram, lifetime ratios named `_ratio`,
a request the client abandoned counted as 499 (not 200), the tenant on audit hit lines and admin
switch changes in the audit log; the CLI writes the audit log by default."""

from __future__ import annotations

import json

import httpx
import pytest

from kvpage.cli import main as cli_main

from .conftest import MODEL

PROMPT = "Metrics and audit: a prompt long enough to fill two blocks of sixteen."


def _lines(server) -> list[dict]:
    return [json.loads(line) for line in server.audit_path.read_text().splitlines()]


def test_token_counters_and_e2e_latency(open_server):
    m0 = open_server.metrics()
    out = open_server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0
    )
    open_server.wait_idle()
    m1 = open_server.metrics()
    grew = lambda name: m1[name] - m0.get(name, 0)  # noqa: E731
    assert grew("kvpage_prompt_tokens_total") == out.usage.prompt_tokens
    assert grew("kvpage_generation_tokens_total") == out.usage.completion_tokens == 7
    assert grew("kvpage_e2e_request_latency_seconds_count") == 1
    assert "kvpage_prefix_cache_hit_ratio" in m1 and "kvpage_pollution_ratio" in m1
    assert not any(name.endswith("_rate") for name in m1)


def test_abandoned_stream_is_not_counted_as_200(open_server):
    key = "kvpage_http_requests_total{path=/v1/completions,status=%s}"
    m0 = open_server.metrics()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{open_server.url}/v1/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            break  # the client reads one chunk and hangs up
    open_server.wait_idle()
    m1 = open_server.metrics()
    assert m1.get(key % "200", 0) == m0.get(key % "200", 0)
    assert m1.get(key % "499", 0) == m0.get(key % "499", 0) + 1


def test_hit_lines_carry_the_tenant_and_never_the_salt(tenant_server):
    client = tenant_server.client("key-alice")
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="Tenant audit: " + PROMPT, max_tokens=2)
    tenant_server.wait_idle()
    hits = [e for e in _lines(tenant_server) if e["event"] == "prefix_hit"]
    assert hits and hits[-1]["tenant"] == "alice"
    text = tenant_server.audit_path.read_text()
    assert "key-alice" not in text


def test_admin_switch_changes_are_audited(tenant_server):
    tenant_server.admin("prefix-caching", {"enabled": False, "tenant": "bob"})
    tenant_server.admin("prefix-caching", {"enabled": True, "tenant": "bob"})
    tenant_server.admin("preemption", {"enabled": True})
    switches = [e for e in _lines(tenant_server) if e["event"] == "admin_switch"]
    assert [s.get("prefix_caching") for s in switches[-3:-1]] == [False, True]
    assert switches[-2]["tenant"] == "bob" and switches[-2]["scope"] == "namespace"
    assert switches[-1]["preemption"] is True


def test_cli_writes_the_audit_log_by_default(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default: kvpage-audit.jsonl" in help_text and "stderr" in help_text
