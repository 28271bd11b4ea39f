"""Metrics move as expected, the audit log has one line per prefix hit / free (with the fields
that explain a hit: namespace, prefix digest, tokens, blocks, last block full), and the shadow
comparison re-checks cache hits and counts pollution."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from kvpage import EngineConfig, LLMEngine, SamplingParams
from kvpage.server import ServerOptions, create_app
from kvpage.server.audit import AuditLog
from kvpage.server.background import BackgroundServer
from kvpage.server.shadow import ShadowChecker, ShadowJob, first_difference
from tests.waiting import READY_S, settled

from .conftest import MODEL, NUM_BLOCKS, Server

PROMPT = "Observability: a prompt long enough for three blocks."


def _wait(predicate, timeout: float = READY_S) -> bool:
    return settled(predicate, bool, timeout)


def test_metrics_move(open_server):
    m0 = open_server.metrics()
    client = open_server.client()
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    open_server.wait_idle()
    m1 = open_server.metrics()
    grew = lambda name: m1[name] - m0.get(name, 0)  # noqa: E731
    assert grew("kvpage_prefix_cache_queries_tokens_total") == 2 * (len(PROMPT) + 1)
    assert grew("kvpage_prefix_cache_hits_tokens_total") == 48
    assert 0 < m1["kvpage_prefix_cache_hit_ratio"] <= 1
    assert grew("kvpage_time_to_first_token_seconds_count") == 2
    assert grew("kvpage_inter_token_latency_seconds_count") == 2 * 4
    assert grew("kvpage_kv_block_allocations_total") > 0
    assert grew("kvpage_kv_block_frees_total") > 0
    assert grew("kvpage_kv_block_generation_bumps_total") > 0
    assert grew("kvpage_http_requests_total{path=/v1/completions,status=200}") == 2
    states = [f"kvpage_kv_blocks{{state={s}}}" for s in ("free", "private", "shared", "cached")]
    assert sum(m1[s] for s in states) == NUM_BLOCKS
    assert m1["kvpage_kv_blocks{state=private}"] == m1["kvpage_kv_blocks{state=shared}"] == 0
    assert m1["kvpage_requests{queue=running}"] == m1["kvpage_requests{queue=waiting}"] == 0
    for name in (
        "kvpage_preemptions_total{mode=recompute}",
        "kvpage_preemptions_total{mode=swap}",
        "kvpage_kv_cow_copies_total",
        "kvpage_cache_corruptions_total",
        "kvpage_restore_latency_seconds_count",
        "kvpage_pollution_ratio",
    ):
        assert name in m1


def test_audit_lines(open_server):
    client = open_server.client()
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="Audit: " + PROMPT, max_tokens=3)
    open_server.wait_idle()
    lines = [json.loads(line) for line in open_server.audit_path.read_text().splitlines()]
    hits = [e for e in lines if e["event"] == "prefix_hit"]
    assert hits, "no prefix_hit line"
    hit = hits[-1]
    for field in ("namespace", "prefix_digest", "token_count", "blocks_hit", "last_block_full"):
        assert field in hit
    assert hit["token_count"] == 16 * len(hit["blocks_hit"]) and hit["last_block_full"] is True
    assert len(bytes.fromhex(hit["prefix_digest"])) == 32
    frees = [e for e in lines if e["event"] == "free" and e["request_id"] == hit["request_id"]]
    assert frees and {"blocks", "generations", "reason"} <= set(frees[-1])


def test_shadow_checks_cache_hits(open_server):
    before = open_server.metrics()["kvpage_shadow_checks_total"]
    client = open_server.client()
    for seed in (None, 5):
        extra = {"temperature": 0.7, "seed": seed} if seed else {"temperature": 0}
        for _ in range(2):  # the second request of each pair hits the cache
            client.completions.create(
                model=MODEL, prompt=f"Shadow {seed}: {PROMPT}", max_tokens=8, **extra
            )
    done = lambda: open_server.metrics()["kvpage_shadow_checks_total"] >= before + 2  # noqa: E731
    assert _wait(done)
    m = open_server.metrics()
    assert m["kvpage_shadow_mismatches_total"] == 0 and m["kvpage_pollution_ratio"] == 0


def test_shadow_mismatch_counts_pollution(offline, tmp_path):
    """A served result that differs from the reference is pollution, with an alert line."""
    audit = AuditLog(tmp_path / "audit.jsonl", sample_rate=0.0)  # alerts are never sampled out
    checker = ShadowChecker(offline.engine.model, audit, rate=1.0)
    prompt_ids = [256, *PROMPT.encode()]
    params = SamplingParams(max_tokens=6)
    served = offline.generate(prompt_ids, params, use_tqdm=False)[0].outputs[0].token_ids
    assert checker.check(ShadowJob("ok", prompt_ids, params, served, 32)) is None
    polluted = [*served[:3], (served[3] + 1) % 256, *served[4:]]
    assert checker.check(ShadowJob("bad", prompt_ids, params, polluted, 32)) == 3
    assert checker.counts() == (2, 1)
    alert = json.loads((tmp_path / "audit.jsonl").read_text().splitlines()[-1])
    assert alert["event"] == "shadow_mismatch" and alert["step"] == 3
    assert alert["served_token"] == polluted[3] and alert["reference_token"] == served[3]
    audit.close()


def test_shadow_sampling_rules(offline):
    checker = ShadowChecker(offline.engine.model, AuditLog(sample_rate=0.0), rate=1.0)
    unseeded = SamplingParams(temperature=0.8, max_tokens=2)
    checker.offer(ShadowJob("miss", [1, 2], SamplingParams(), [3], cached_tokens=0))
    checker.offer(ShadowJob("unseeded", [1, 2], unseeded, [3], cached_tokens=16))
    assert checker._jobs.qsize() == 0  # neither a miss nor an unseeded sample is comparable
    checker.offer(ShadowJob("hit", [1, 2], SamplingParams(), [3], cached_tokens=16))
    assert checker._jobs.qsize() == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1], [1]) is None


def test_swap_preemption_is_audited(tmp_path):
    """Swap mode on a small pool: preempt, swap-out and swap-in (restore) lines, restore latency
    observed."""
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=24, preemption_mode="swap"))
    options = ServerOptions(model_name=MODEL, shadow_rate=0.0, audit_log=tmp_path / "a.jsonl")
    with BackgroundServer(create_app(engine, options)) as bg:
        server = Server(bg.url, tmp_path / "a.jsonl")
        client = server.client()

        def one(i: int) -> int:
            r = client.completions.create(
                model=MODEL,
                prompt=f"swap {i}",
                max_tokens=120,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.usage.completion_tokens

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, range(4), timeout=60)) == [120] * 4
        m = server.metrics()
    events = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    preempts = [e for e in events if e["event"] == "preempt"]
    restores = [e for e in events if e["event"] == "swap_in"]
    assert preempts and {"request_id", "mode", "blocks", "generations"} <= set(preempts[0])
    assert any(e["mode"] == "swap" for e in preempts)
    assert {"request_id", "sample_id", "latency_s", "blocks"} <= set(restores[0])
    assert len([e for e in events if e["event"] == "swap_out"]) >= len(restores)
    assert restores and m["kvpage_restore_latency_seconds_count"] == len(restores)
    assert m["kvpage_preemptions_total{mode=swap}"] >= len(restores)
