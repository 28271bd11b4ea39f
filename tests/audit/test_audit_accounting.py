"""Phantom cache hits: a cached-token count above what the audit shared in the
request's namespace is an accounting anomaly, and isolation evidence when the answer changed."""

from __future__ import annotations

import os
import zlib

from kvpage.audit.accounting import Accounting
from kvpage.audit.capabilities import Capabilities
from kvpage.audit.classify import ISOLATION
from kvpage.audit.completion import Completion
from kvpage.audit.config import AuditConfig
from kvpage.audit.probes import PromptFactory
from kvpage.audit.runner import run_audit
from kvpage.audit.suites.base import SuiteContext
from tests.audit.servers import MODEL, kvpage_server, proxy_app, serve_app


def body(ids: list[int], salt: str | None = None) -> dict:
    out = {"prompt": ids}
    return out if salt is None else {**out, "cache_salt": salt}


def test_what_a_request_may_be_served_from_cache():
    acc = Accounting(separate_salts=True)
    a = acc.register(body(list(range(100, 164)), "s1"))
    assert acc.bound(a) == 0  # nothing else sent under s1
    b = acc.register(body(list(range(100, 132)) + [7] * 32, "s1"))
    assert acc.bound(b) == 32 and acc.bound(a) == 32  # concurrent: each may hit the other
    c = acc.register(body(list(range(100, 164)), "s2"))
    assert acc.bound(c) == 0  # another salt: a separate cache
    again = acc.register(body(list(range(100, 164)), "s1"))
    assert acc.bound(again) == 64
    shared = Accounting(separate_salts=False)  # salts that do not separate: one namespace
    x, y = (shared.register(body(list(range(100, 164)), s)) for s in ("s1", "s2"))
    assert shared.bound(y) == 64
    text = shared.register({"prompt": "abc"})
    assert shared.bound(text) is None  # a text prompt's tokens are unknown
    assert shared.bound(x) == 64  # a text prompt shares at most its BOS and one more token
    assert shared.bound(shared.register(body([1, 2, 3]))) == 2


def test_a_count_above_the_bound_is_recorded_with_its_evidence():
    acc = Accounting(separate_salts=True, phase="prefix")
    fresh = acc.register(body(list(range(100, 140)), "fresh"))
    assert acc.check(fresh, 0, "40 token ids") == 0 and not acc.anomalies
    assert acc.check(fresh, 32, "40 token ids") == 0
    (anomaly,) = acc.anomalies
    assert (anomaly.suite, anomaly.cached_tokens, anomaly.shared_bound) == ("prefix", 32, 0)
    assert "fresh cache salt" in anomaly.sentence()


def test_a_phantom_hit_with_a_changed_answer_is_isolation():
    cfg = AuditConfig(base_url="http://127.0.0.1:1", model="m", progress=False)
    ctx = SuiteContext(cfg, Capabilities(cache_salt=True), None, PromptFactory(0, (3, 250)))
    top = [{"a": -0.5}, {"b": -0.70, "x": -0.72}]  # a near-tie: drift, were it not for the hit
    ref = Completion("ab", tokens=["a", "b"], logprobs=[-0.5, -0.7], top=top)
    cand = Completion("ax", tokens=["a", "x"], logprobs=[-0.5, -0.71], top=top)
    cand.cached_tokens, cand.shared_bound = 64, 32
    check = ctx.judge("prefix", "p", ref, cand, {})
    assert check.klass == ISOLATION and "phantom hit" in check.reason
    cand.shared_bound = 64
    assert ctx.judge("prefix", "p", ref, cand, {}).klass != ISOLATION


def test_a_server_reporting_phantom_hits_is_flagged_with_identical_answers():
    """The proxy adds 16 cached tokens to every answer of an honest kvpage: the answers are
    right, the accounting is not."""
    seed = zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode())
    with kvpage_server() as upstream, serve_app(proxy_app(upstream, phantom=16)) as url:
        cfg = AuditConfig(url, MODEL, block_sizes=(16,), probes=3, progress=False, seed=seed)
        result = run_audit(AuditConfig(**{**_fields(cfg), "suites": ("baseline", "prefix")}))
    assert result.anomalies and result.exit_code == 1
    assert result.verdict == "CACHE ACCOUNTING ANOMALY"
    assert not any(c.klass == ISOLATION for s in result.suites for c in s.checks)
    fresh = [a for a in result.anomalies if a.shared_bound < 16]  # less than one block shared
    assert fresh and all(a.cached_tokens == 16 for a in fresh)
    data = result.to_json()
    assert any("phantom cache hit" in s for s in data["findings"]["found"])


def _fields(cfg: AuditConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__slots__}
