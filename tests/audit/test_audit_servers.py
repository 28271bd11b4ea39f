"""The audit against real servers on loopback: an honest kvpage passes every suite, and each
planted fault is caught by the suite it belongs to, with the right class — proving that each
verdict can fail."""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import replace

import pytest

from kvpage.audit.classify import DRIFT, FAILED, ISOLATION
from kvpage.audit.config import AuditConfig
from kvpage.audit.report import write_reports
from kvpage.audit.runner import run_audit
from kvpage.audit.suites.timing import INCONCLUSIVE, ISOLATED, SHARED
from tests.audit.servers import (
    KEYS,
    MODEL,
    batched_logits_in_bfloat16,
    kvpage_server,
    proxy_app,
    serve_app,
)


def small(url: str, **overrides) -> AuditConfig:
    """A reduced audit: one block size, few probes, short timing (seconds, not minutes). Its
    seed comes from the test's id: reproducible, and different for every test sharing a
    server (so no test's "fresh" prompts were cached by another's)."""
    test_id = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    cfg = AuditConfig(
        base_url=url,
        model=MODEL,
        block_sizes=(16,),
        budget_requests=300,
        probes=4,
        canary_group=4,
        timing_trials=6,
        timing_prefix_tokens=1024,
        progress=False,
        seed=zlib.crc32(test_id.encode()),
    )
    return replace(cfg, **overrides)


def suites(result) -> dict:
    return {s.name: s for s in result.suites}


@pytest.fixture(scope="module")
def honest_url():
    with kvpage_server() as url:
        yield url


def test_honest_kvpage_passes_every_suite(honest_url, tmp_path):
    result = run_audit(small(honest_url, block_sizes=(16, 32)))
    got = suites(result)
    assert result.exit_code == 0, {n: s.verdict for n, s in got.items()}
    assert got["baseline"].verdict == "exact"
    assert [got[n].verdict for n in ("batch", "prefix", "canaries")] == ["clean"] * 3
    assert got["timing"].verdict == ISOLATED  # tenants are two cache salts on an open server
    assert got["prefix"].checks and not got["prefix"].divergences
    assert result.block_size() == 16  # kvpage's default block, from the cached-token counts
    assert result.requests <= 300
    data = write_reports(result, tmp_path)
    assert data["seed"] == result.cfg.seed
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["suites"]["timing"]["verdict"] == ISOLATED == data["suites"]["timing"]["verdict"]
    assert "prefix: clean" in (tmp_path / "report.md").read_text()
    assert "<svg" in (tmp_path / "report.html").read_text()


def test_two_api_keys_are_isolated_tenants():
    with kvpage_server(api_keys=KEYS) as url:
        cfg = small(url, api_key="key-alice", second_api_key="key-bob", suites=("timing",))
        result = run_audit(cfg)
    timing = suites(result)["timing"]
    assert timing.verdict == ISOLATED, timing.summary
    assert result.caps.cache_salt is False  # a keyed kvpage refuses client salts
    assert result.exit_code == 0


def test_salt_blind_namespace_is_shared_across_tenants():
    with kvpage_server(api_keys=KEYS, mutant="namespace_missing_field") as url:
        cfg = small(url, api_key="key-alice", second_api_key="key-bob", suites=("timing",))
        result = run_audit(cfg)
    timing = suites(result)["timing"]
    assert timing.verdict == SHARED
    assert all(c and c > 0 for c in timing.data["cached_tokens"]["cross"])
    assert result.exit_code == 1
    findings = result.to_json()["findings"]
    assert any("timing: a second tenant was served" in f for f in findings["found"])
    assert any("across API keys" in f for f in findings["to_do"]), findings["to_do"]


def test_timing_alone_sees_the_leak_and_the_isolation(honest_url):
    """--ignore-usage: the verdict from TTFT only (Mann–Whitney U against cold)."""
    cfg = small(honest_url, suites=("timing",), trust_usage=False, timing_trials=8)
    honest = suites(run_audit(cfg))["timing"]
    assert honest.verdict == ISOLATED, honest.summary
    assert honest.data["tests"]["same_vs_cold"]["p"] < 0.01
    with kvpage_server(mutant="namespace_missing_field") as url:
        leaky = suites(run_audit(replace(cfg, base_url=url)))["timing"]
    assert leaky.verdict == SHARED, leaky.summary
    assert leaky.data["tests"]["cross_vs_cold"]["p"] < 0.01
    assert leaky.data["tests"]["cross_vs_cold"]["effect"] <= -0.5


def test_leaked_tokens_are_a_canary_failure_attributed_to_the_pair(honest_url):
    with serve_app(proxy_app(honest_url, leak=True)) as url:
        result = run_audit(small(url, suites=("canaries",)))
    canaries = suites(result)["canaries"]
    assert canaries.verdict == FAILED
    sightings = [c for c in canaries.checks if c.pair]
    assert sightings
    for check in sightings:
        owner, victim = check.pair
        assert check.klass == ISOLATION and "foreign canary" in check.reason
        assert owner != victim and owner.split("/")[0] == victim.split("/")[0]  # same group
        assert check.name == victim and check.divergence.index == 2
    assert result.exit_code == 1


@pytest.mark.parametrize(
    ("mutant", "suite", "num_blocks", "preemption"),
    [
        ("off_by_one_block_boundary", "prefix", 256, "recompute"),  # wrong after a boundary hit
        ("block_key_own_tokens", "prefix", 256, "recompute"),
        ("fast_key_trusted", None, 256, "recompute"),  # collisions land in any suite
        ("zero_length_cu_seqlens", "batch", 256, "recompute"),
        ("share_partial_no_cow", "prefix", 256, "recompute"),
        ("no_refcount", "prefix", 64, "recompute"),
        # a small pool, so that the batch suite's pressure round swaps and evicts
        ("restore_visible_before_copy", "batch", 24, "swap"),
        ("stale_index_after_evict", "batch", 24, "recompute"),
    ],
)
def test_injected_faults_are_isolation_failures(mutant, suite, num_blocks, preemption):
    """Each planted bug makes the suite where it lives (any, for random key collisions) an
    isolation failure, and no divergence it causes is excused as noise."""
    with kvpage_server(mutant=mutant, num_blocks=num_blocks, preemption_mode=preemption) as url:
        result = run_audit(small(url, suites=("baseline", "batch", "prefix")))
    got = suites(result)
    # alone, twice (fresh salts), the fault shows only if a fresh salt was served cached tokens
    assert got["baseline"].verdict in ("exact", FAILED)
    caught = [s for s in result.suites if s.verdict == FAILED]
    assert caught and (suite is None or got[suite] in caught), {
        n: s.verdict for n, s in got.items()
    }
    for found in caught:
        classes = {c.klass for c in found.divergences}
        assert ISOLATION in classes and "noise" not in classes
    assert result.exit_code == 1


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_an_honest_small_pool_under_pressure_is_clean(preemption):
    """The pressure round preempts and evicts on a 24-block pool: still no divergence."""
    with kvpage_server(num_blocks=24, preemption_mode=preemption) as url:
        result = run_audit(small(url, suites=("baseline", "batch", "prefix")))
    got = suites(result)
    assert [got[n].verdict for n in ("batch", "prefix")] == ["clean", "clean"]
    assert any(c.name.startswith("marker") for c in got["batch"].checks)
    assert result.exit_code == 0


def test_batch_rounding_is_numeric_drift_not_isolation():
    with kvpage_server(seam=batched_logits_in_bfloat16) as url:
        result = run_audit(small(url, suites=("baseline", "batch", "prefix")))
    got = suites(result)
    assert got["batch"].verdict == "numeric drift"
    assert {c.klass for c in got["batch"].divergences} == {DRIFT}
    assert not any(c.klass == ISOLATION for s in result.suites for c in s.checks)
    assert result.exit_code == 0


def test_a_text_only_server_is_audited_from_text(honest_url):
    """What `transformers serve` offers: string prompts, no logprobs, no usage details; and
    the proxy drops `cache_salt` after accepting it, so "another salt" is the same cache."""
    with serve_app(proxy_app(honest_url, text_only=True)) as url:
        # the proxy's own latency hides small TTFT gaps: longer prefixes, more trials
        timing = {"timing_prefix_tokens": 2048, "timing_trials": 8}
        result = run_audit(
            small(url, suites=("baseline", "prefix", "canaries", "timing"), **timing)
        )
    caps, got = result.caps, suites(result)
    assert caps.id_range is None and caps.text_prompts and not caps.logprobs
    assert not caps.cached_tokens and not caps.return_token_ids
    assert any("token-id prompts refused" in n for n in caps.notes)
    assert got["baseline"].verdict == "exact" and got["canaries"].verdict == "clean"
    assert got["canaries"].checks and got["prefix"].checks  # judged from text alone
    assert all(c.cand.tokens is None for c in got["prefix"].checks)
    # From TTFT alone (the proxy adds latency noise): never "isolated", the salts share a cache
    assert got["timing"].verdict in (SHARED, INCONCLUSIVE), got["timing"].summary
    if got["timing"].verdict == SHARED:
        assert "cache_salt only" in got["timing"].summary and result.exit_code == 1
