"""`--reference-model`: answers judged against kvpage's contiguous reference generator
on the served checkpoint. An honest server agrees with it; a server whose answers are wrong the
same way cold and warm passes every self-comparison and fails against the reference."""

from __future__ import annotations

import pytest

from kvpage.audit.classify import FAILED, ISOLATION
from kvpage.audit.config import AuditConfig
from kvpage.audit.errors import AuditUsageError
from kvpage.audit.runner import run_audit
from tests.audit.servers import MODEL, kvpage_server, proxy_app, serve_app

SUITES = ("baseline", "batch")  # non-streamed answers only (the proxy rewrites no streams)


def config(url: str, reference: str | None, seed: int) -> AuditConfig:
    return AuditConfig(
        url,
        MODEL,
        block_sizes=(16,),
        probes=4,
        suites=SUITES,
        progress=False,
        seed=seed,
        reference_model=reference,
    )


@pytest.fixture(scope="module")
def honest_url():
    with kvpage_server() as url:
        yield url


def test_an_honest_server_agrees_with_the_reference(honest_url):
    result = run_audit(config(honest_url, MODEL, 261))
    suites = {s.name: s for s in result.suites}
    reference = suites["reference"]
    assert result.exit_code == 0 and reference.verdict == "clean", reference.summary
    data = reference.data
    assert data["answers"] >= 8 and data["same_tokens"] == data["answers"]
    assert data["max_logprob_delta_same_tokens"] < 1e-3


def test_answers_wrong_alike_cold_and_warm_are_caught_only_by_the_reference(honest_url):
    with serve_app(proxy_app(honest_url, wrong_alike=True)) as url:
        alone = run_audit(config(url, None, 262))
        judged = run_audit(config(url, MODEL, 263))
    assert alone.exit_code == 0, {s.name: s.verdict for s in alone.suites}  # blind to it
    reference = {s.name: s for s in judged.suites}["reference"]
    assert reference.verdict == FAILED and judged.exit_code == 1
    bad = [c for c in reference.checks if c.klass == ISOLATION]
    assert bad and all(c.divergence.index == 3 for c in bad)
    assert all(c.reason.startswith("vs reference") for c in bad)


def test_a_reference_that_cannot_load_is_a_usage_error(honest_url, tmp_path):
    with pytest.raises(AuditUsageError, match="--reference-model"):
        run_audit(config(honest_url, str(tmp_path / "nothing"), 264))


def test_the_cli_flag_adds_the_reference_suite(honest_url, tmp_path):
    import json

    from kvpage.cli import main

    report = tmp_path / "r"
    args = ["audit", "--base-url", honest_url, "--model", MODEL, "--quiet", "--report", str(report)]
    args += ["--suites", "baseline", "--probes", "2", "--reference-model", MODEL]
    assert main(args) == 0
    data = json.loads((report / "report.json").read_text())
    assert data["suites"]["reference"]["verdict"] == "clean"
    assert data["suites"]["reference"]["data"]["reference"]["model"] == MODEL
