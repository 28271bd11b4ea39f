"""The passphrase experiment on the trained model, fast version: sharing the partial block
without refcount or copy-on-write leaks secrets between concurrent requests; no sharing and
refcount+CoW never do."""

from __future__ import annotations

import json

import pytest

from kvpage.experiments.passphrase import ExperimentConfig, run_experiment


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    out = tmp_path_factory.mktemp("passphrase")
    results = run_experiment(ExperimentConfig(runs=10, seed=1), out, progress=False)
    return results, out


def test_unsafe_sharing_contaminates_and_safe_groups_do_not(experiment):
    results, _ = experiment
    g = results["groups"]
    assert g["shared_no_cow"]["contaminated"] > 0
    for safe in ("no_sharing", "shared_cow"):
        assert g[safe]["contaminated"] == 0, g[safe]["leak_pairs"]
        assert g[safe]["correct"] / g[safe]["requests"] >= 0.99
        assert g[safe]["runs"] == 10 and g[safe]["requests"] == 20


def test_leak_pairs_name_victim_and_source(experiment):
    results, _ = experiment
    for leak in results["groups"]["shared_no_cow"]["leak_pairs"]:
        assert leak["victim"] != leak["source"]
        assert leak["answer"] != leak["victim_secret"]


def test_ref_counts_show_the_missing_reference(experiment):
    results, _ = experiment
    assert set(results["groups"]["shared_no_cow"]["shared_block_ref_counts"]) == {"1"}
    assert set(results["groups"]["shared_cow"]["shared_block_ref_counts"]) == {"2"}
    assert results["groups"]["no_sharing"]["shared_block_ref_counts"] == {}


def test_outputs_written(experiment):
    results, out = experiment
    assert (
        json.loads((out / "results.json").read_text())["groups"].keys() == results["groups"].keys()
    )
    report = (out / "report.md").read_text()
    assert "| shared_no_cow |" in report
    assert (out / "attention_shared_no_cow_contaminated.png").stat().st_size > 10_000
    assert (out / "attention_shared_cow_clean.png").stat().st_size > 10_000
