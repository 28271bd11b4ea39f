"""bench/serving.py's pure parts (no server runs): the request stream it synthesizes and the
numbers it computes from per-request timestamps, each checked against numpy computing the same
definitions independently."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from bench import serving_metrics as sm
from bench import serving_workload as sw


# --- percentiles --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1001])
def test_percentile_is_numpys_linear_percentile(n):
    rng = random.Random(n)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert sm.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert math.isnan(sm.percentile([], 50))


# --- one run's numbers --------------------------------------------------------------------------
def _records(rng: random.Random, n: int, start: float) -> tuple[list[sm.RequestRecord], list[int]]:
    """Hand-built requests: random send times, gaps and chunk counts; some chunks carry several
    tokens (output tokens > chunks), one request fails, one has a single output token."""
    records, prompts = [], []
    for i in range(n):
        sent = start + rng.uniform(0, 5)
        chunks = 1 if i == 3 else rng.randint(2, 30)
        t = sent + rng.uniform(0.05, 2.0)
        times = [t]
        for _ in range(chunks - 1):
            t += rng.uniform(0.001, 0.3)
            times.append(t)
        tokens = 1 if i == 3 else chunks + rng.randint(0, 3)
        rec = sm.RequestRecord(sent, times, t + rng.uniform(0, 0.01), tokens, None)
        prompt = rng.randint(64, 1024)
        rec.prompt_tokens = prompt + (1 if i == 5 else 0)  # one server-side count off by one
        if i == 7:
            rec.error = "ReadTimeout"
        records.append(rec)
        prompts.append(prompt)
    return records, prompts


def test_summary_matches_an_independent_computation():
    rng = random.Random(7)
    start = 1000.0
    records, prompts = _records(rng, 40, start)
    slo = sm.Slo(ttft_ms=1200, tpot_ms=120)
    got = sm.summarize(records, start, slo, prompts)

    ok = [r for r in records if r.error is None]
    sent = np.array([r.sent for r in ok])
    first = np.array([r.token_times[0] for r in ok])
    done = np.array([r.done for r in ok])
    out = np.array([r.output_tokens for r in ok])
    ttft, e2e = first - sent, done - sent
    multi = out > 1
    tpot = (e2e[multi] - ttft[multi]) / (out[multi] - 1)
    itl = np.concatenate([np.diff(r.token_times) for r in ok])
    duration = done.max() - start
    tpot_all = np.where(multi, (e2e - ttft) / np.maximum(out - 1, 1), 0.0)
    good = np.sum((ttft <= slo.ttft_ms / 1e3) & (tpot_all <= slo.tpot_ms / 1e3))

    assert (got.completed, got.failed) == (len(ok), 1)
    assert got.duration_s == pytest.approx(duration)
    assert got.request_per_s == pytest.approx(len(ok) / duration)
    assert got.output_tok_per_s == pytest.approx(out.sum() / duration)
    assert got.goodput_per_s == pytest.approx(good / duration)
    # each half of the SLO turns some request away on its own: goodput checks both
    ttft_ok, tpot_ok = ttft <= slo.ttft_ms / 1e3, tpot_all <= slo.tpot_ms / 1e3
    assert np.any(ttft_ok & ~tpot_ok) and np.any(~ttft_ok & tpot_ok) and good > 0
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for q in sm.QUANTILES:
            assert got.latency_ms[name][q] == pytest.approx(1e3 * np.percentile(xs, q)), name
    assert len(itl) == sum(len(r.token_times) - 1 for r in ok)
    assert got.prompt_mismatches == 1


def test_a_run_where_nothing_completed_has_no_rates():
    rec = sm.RequestRecord(sent=1.0, error="ConnectError")
    got = sm.summarize([rec], 0.5, sm.Slo(), [100])
    assert (got.completed, got.failed) == (0, 1)
    assert math.isnan(got.request_per_s) and math.isnan(got.latency_ms["ttft"][99])


def test_a_rate_is_sustained_when_all_complete_within_the_ttft_slo():
    rng = random.Random(5)
    records, prompts = _records(rng, 30, 0.0)
    records[7].error = None  # all complete
    run = sm.summarize(records, 0.0, sm.Slo(), prompts)
    p99 = 1e3 * np.percentile([r.token_times[0] - r.sent for r in records], 99)
    assert sm.sustains(run, sm.Slo(ttft_ms=p99 + 1))
    assert not sm.sustains(run, sm.Slo(ttft_ms=p99 - 1))
    records[0].error = "ReadTimeout"
    failed = sm.summarize(records, 0.0, sm.Slo(), prompts)
    assert not sm.sustains(failed, sm.Slo(ttft_ms=1e9))


def test_over_rounds_takes_the_best_and_median_round_per_quantity():
    rng = random.Random(3)
    runs = []
    for _ in range(5):
        records, prompts = _records(rng, 20, 0.0)
        runs.append(sm.summarize(records, 0.0, sm.Slo(), prompts))
    got = sm.over_rounds(runs)
    rates = np.array([r.request_per_s for r in runs])
    assert got["req/s"] == (pytest.approx(rates.max()), pytest.approx(np.median(rates)))
    p99 = np.array([r.latency_ms["ttft"][99] for r in runs])
    assert got["ttft p99"] == (pytest.approx(p99.min()), pytest.approx(np.median(p99)))
    assert len(set(p99)) == 5  # distinct rounds: min, max and median are different rounds


# --- the stream ---------------------------------------------------------------------------------
def test_stream_has_the_asked_lengths_and_shared_system_prompt():
    shape = sw.StreamShape(requests=200)
    stream = sw.make_stream(1.0, shape, vocab=32000, seed=0)
    assert len(stream) == 200
    shared = [r for r in stream if r.shared]
    assert len(shared) == 40  # 20%
    system = shared[0].prompt[:512]
    assert all(r.prompt[:512] == system for r in shared)
    assert all(r.prompt[:512] != system for r in stream if not r.shared)
    assert all(64 <= len(r.prompt) <= 1024 for r in stream)
    assert all(512 + 64 <= len(r.prompt) <= 1024 for r in shared)
    assert all(16 <= r.max_tokens <= 256 for r in stream)
    assert len({r.max_tokens for r in stream}) > 50 and len({len(r.prompt) for r in stream}) > 100
    assert all(3 <= t < 32000 for r in stream for t in r.prompt)
    arrivals = [r.arrival_s for r in stream]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


def test_streams_are_seeded_per_rate():
    shape = sw.StreamShape(requests=30)
    a = sw.make_stream(2.0, shape, 32000, seed=0)
    assert a == sw.make_stream(2.0, shape, 32000, seed=0)
    other_rate = sw.make_stream(0.5, shape, 32000, seed=0)
    other_seed = sw.make_stream(2.0, shape, 32000, seed=1)
    first_shared = next(r for r in a if r.shared).prompt[:512]
    assert next(r for r in other_rate if r.shared).prompt[:512] != first_shared
    assert [r.prompt for r in other_seed] != [r.prompt for r in a]


def test_arrivals_are_a_poisson_process_of_the_rate():
    rate, n = 2.5, 20000
    times = np.array(sw.poisson_arrivals(random.Random(11), rate, n))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)  # exponential: CV 1
    # Kolmogorov-Smirnov against the exponential CDF, at the 1% level
    xs = np.sort(gaps)
    cdf = 1 - np.exp(-rate * xs)
    d = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert d < 1.63 / math.sqrt(n)
    # counts per unit time are Poisson: variance about the mean
    counts = np.bincount(times.astype(int))[:-1]
    assert counts.var() / counts.mean() == pytest.approx(1.0, rel=0.1)


def test_warmup_spans_the_prompt_range_with_its_own_tokens():
    shape = sw.StreamShape()
    warm = sw.warmup_stream(shape, 32000, seed=0, n=8)
    lengths = [len(r.prompt) for r in warm]
    assert lengths[0] == 64 and lengths[-1] == 1024 and lengths == sorted(set(lengths))
    assert all(r.arrival_s == 0 and r.max_tokens == 16 for r in warm)
    # no warm-up prompt shares a first KV block (16 tokens) with a timed prompt
    timed = {
        tuple(r.prompt[:16])
        for rate in (0.5, 1.0, 2.0)
        for r in sw.make_stream(rate, shape, 32000, 0)
    }
    assert not timed & {tuple(r.prompt[:16]) for r in warm}
