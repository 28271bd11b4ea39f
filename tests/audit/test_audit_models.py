"""The models suite against kvpage serving LoRA adapters on loopback: an honest server keeps the
base and each adapter apart (and says so), the adapter left out of the cache namespace (vLLM
#3264) or keyed where the tenant salt goes (vLLM #44701) is reported naming both models, a
one-model server is skipped with the reason — and the same by TTFT alone."""

from __future__ import annotations

import json

import pytest

from kvpage.audit.classify import FAILED
from kvpage.audit.report import write_reports
from kvpage.audit.runner import run_audit
from kvpage.audit.suites.models import NOT_APPLICABLE, SALTED, SHARED_MODELS
from kvpage.audit.suites.timing import ISOLATED
from kvpage.verify.lora_adapters import LoraSpec
from tests.audit.servers import KEYS, MODEL, kvpage_server
from tests.audit.test_audit_servers import small, suites

A = LoraSpec("a", seed=11)
B = LoraSpec("b", seed=12, targets=("q_proj", "v_proj", "down_proj"), rank=8)
LEAKS = ("lora_left_out_of_namespace", "lora_name_in_salt_field")


def models_of(result):
    return suites(result)["models"]


def test_honest_adapters_are_isolated_and_reported(tmp_path):
    with kvpage_server(adapters=(A, B)) as url:
        result = run_audit(small(url, suites=("baseline", "models"), probes=2))
    models = models_of(result)
    assert models.verdict == ISOLATED, models.summary
    assert result.exit_code == 0 and result.verdict == "isolated (no isolation failure found)"
    rows = models.data["pairs"]
    assert [r["models"] for r in rows] == [[MODEL, "a"], [MODEL, "b"], ["a", "b"]]
    for row in rows:
        assert row["verdict"] == ISOLATED and row["relation"] == "adapter"
        for d in row["directions"]:  # the control hits, the other model's prefix does not
            cached = d["cached_tokens"]
            assert cached["same"][0] > 0 and cached["cross"] == [0] and cached["salted"] == [0]
    assert len(models.checks) == 6 and not models.divergences  # each cross answer, judged
    assert not result.anomalies
    assert any(n.startswith("models: 3 pair(s)") for n in result.plan_notes), result.plan_notes
    data = write_reports(result, tmp_path)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["suites"]["models"]["verdict"] == ISOLATED == data["suites"]["models"]["verdict"]
    assert {c["id"]: c["parent"] for c in on_disk["capabilities"]["model_cards"]} == {
        MODEL: None,
        "a": MODEL,
        "b": MODEL,
    }
    assert "## models: isolated" in (tmp_path / "report.md").read_text()
    assert "a -&gt; b" in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize("mutant", LEAKS)
def test_a_cache_shared_across_models_is_reported_naming_both(mutant):
    with kvpage_server(adapters=(A, B), mutant=mutant) as url:
        result = run_audit(small(url, suites=("models",)))
    models = models_of(result)
    assert models.verdict in (FAILED, SHARED_MODELS), models.summary
    assert result.exit_code == 1 and result.verdict == "NOT ISOLATED"
    rows = {tuple(r["models"]): r for r in models.data["pairs"]}
    for pair in ((MODEL, "a"), (MODEL, "b")):  # the base against each adapter, both bugs
        assert rows[pair]["verdict"] in (FAILED, SHARED_MODELS), rows[pair]["reason"]
    found = result.to_json()["findings"]
    assert any(f.startswith(f"models: {MODEL} / a: ") for f in found["found"]), found["found"]
    assert any("its own prefix-cache namespace" in t for t in found["to_do"])
    if mutant == "lora_left_out_of_namespace":  # every prefix reaches every other model
        assert all(r["verdict"] in (FAILED, SHARED_MODELS) for r in rows.values())
        for d in rows[(MODEL, "a")]["directions"]:
            assert d["cached_tokens"]["cross"][0] > 0 and d["cached_tokens"]["same"][0] > 0
            assert repr(d["owner"]) in d["shared"] and repr(d["viewer"]) in d["shared"]
    else:  # the base under a salt spelled like the adapter gets the adapter's blocks
        assert "keyed like a tenant's salt" in rows[(MODEL, "a")]["reason"]
        assert rows[("a", "b")]["verdict"] == ISOLATED  # adapters still apart from each other


def test_a_one_model_server_is_skipped_with_the_reason():
    with kvpage_server() as url:
        result = run_audit(small(url, suites=("baseline", "models"), probes=2))
    models = models_of(result)
    assert models.verdict == NOT_APPLICABLE and not models.data["pairs"]
    assert models.untested == [
        f"skipped: /v1/models lists one model ({MODEL!r}): no other model to keep apart from it"
    ]
    skipped = f"models: skipped: /v1/models lists one model ({MODEL!r})"
    assert any(n.startswith(skipped) for n in result.plan_notes), result.plan_notes
    assert any("'models': 0" in n for n in result.plan_notes)  # it sends nothing
    assert result.exit_code == 0 and result.verdict == "isolated (no isolation failure found)"
    found = result.to_json()["findings"]
    assert any(n.startswith("models: skipped: ") for n in found["not_tested"]), found


def test_timing_alone_tells_isolated_models_from_shared_ones():
    """--ignore-usage: by TTFT only, one round per direction and trial (a pool of 1024 blocks
    holds every prefix of a round: an evicted prefix would time like a miss). Long prefixes, so
    that a hit shows on a loaded machine."""
    honest_cfg = {
        "suites": ("models",),
        "trust_usage": False,
        "timing_trials": 8,
        "timing_prefix_tokens": 2048,
    }
    with kvpage_server(adapters=(A,), num_blocks=1024) as url:
        honest = models_of(run_audit(small(url, **honest_cfg)))
    assert honest.verdict == ISOLATED, honest.summary
    assert honest.data["method"] == "timing"
    for d in honest.data["pairs"][0]["directions"]:
        assert d["tests"]["same_vs_cold"]["p"] < 0.01 and "shared" not in d
    with kvpage_server(adapters=(A,), num_blocks=1024, mutant=LEAKS[0]) as url:
        leaky = models_of(run_audit(small(url, **honest_cfg)))
    assert leaky.verdict in (FAILED, SHARED_MODELS), leaky.summary
    for d in leaky.data["pairs"][0]["directions"]:  # the timing alone shows it, both ways
        assert "TTFT on a prefix cached only under" in d.get("shared", ""), d["tests"]
        assert d["tests"]["cross_vs_cold"]["p"] < 0.01


@pytest.mark.parametrize("mutant", [None, LEAKS[0]])
def test_a_keyed_server_without_client_salts_is_judged_by_counts_alone(mutant):
    """kvpage with API keys refuses client salts: no cold answer to judge against, no salted
    arm; the counts still tell isolated models from shared ones."""
    with kvpage_server(api_keys=KEYS, adapters=(A,), mutant=mutant) as url:
        result = run_audit(small(url, api_key="key-alice", suites=("models",)))
    models = models_of(result)
    assert not result.caps.cache_salt and not models.checks
    assert any("not judged against a cold answer" in u for u in models.untested)
    (row,) = models.data["pairs"]
    assert all(SALTED not in d["cached_tokens"] for d in row["directions"])
    if mutant is None:
        assert models.verdict == ISOLATED and result.exit_code == 0, models.summary
    else:
        assert models.verdict == SHARED_MODELS and result.exit_code == 1, models.summary
        assert row["reason"].startswith("'a' was served"), row["reason"]
