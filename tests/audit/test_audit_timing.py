"""The cross-tenant timing verdict on synthetic TTFT samples: a second tenant timed like the
victim's own cache hits is "shared", one timed like cold is "isolated", and a chance dip below
cold that is still clearly slower than real hits is not mistaken for a leak."""

from __future__ import annotations

import random
from types import SimpleNamespace

from kvpage.audit.completion import Completion
from kvpage.audit.suites.timing import INCONCLUSIVE, ISOLATED, SHARED, _data, _verdict

CTX = SimpleNamespace(cfg=SimpleNamespace(alpha=0.01))


def arm(centre_ms: float, n: int = 8, seed: int = 0, cached: int | None = None) -> list[Completion]:
    rng = random.Random(seed)
    return [
        Completion("", ttft_s=(centre_ms + rng.uniform(-1, 1)) / 1000, cached_tokens=cached)
        for _ in range(n)
    ]


def verdict(cold, same, cross, how="second API key", trust_usage=True) -> str:
    data = _data({"cold": cold, "same": same, "cross": cross}, how, 1024, 0.01, trust_usage)
    return _verdict(CTX, data, has_cross=True)[0]


def test_a_second_tenant_timed_like_the_victims_hits_is_shared():
    assert verdict(arm(20, seed=1), arm(8, seed=2), arm(8, seed=3)) == SHARED


def test_a_second_tenant_timed_like_cold_is_isolated():
    assert verdict(arm(20, seed=1), arm(8, seed=2), arm(20, seed=3)) == ISOLATED


def test_a_chance_dip_below_cold_that_is_slower_than_hits_is_not_a_leak():
    assert verdict(arm(20, seed=1), arm(8, seed=2), arm(17, seed=3)) == ISOLATED


def test_no_measurable_reuse_is_inconclusive():
    assert verdict(arm(20, seed=1), arm(20, seed=2), arm(20, seed=3)) == INCONCLUSIVE


def test_cached_tokens_decide_when_trusted():
    cold, same = arm(20, seed=1, cached=0), arm(20, seed=2, cached=512)
    leaked = arm(20, seed=3, cached=512)
    assert verdict(cold, same, leaked) == SHARED  # no TTFT gap at all, the counts say it
    assert verdict(cold, same, leaked, trust_usage=False) == INCONCLUSIVE
    assert verdict(cold, same, arm(20, seed=3, cached=0)) == ISOLATED
