"""The audit's HTTP client against servers with real servers' connection habits: a
keep-alive connection closed before any answer is retried once on a fresh connection and
counted; an answer cut off after its first bytes is never resent; a server that dies mid-audit
is a finding (exit 1) with the partial report written, and exit 2 stays for a server that
cannot be audited at all."""

from __future__ import annotations

import json

import pytest

from kvpage.audit.classify import SERVER_FAILED
from kvpage.audit.client import AuditClient, Budget
from kvpage.audit.config import AuditConfig
from kvpage.audit.errors import ServerUnreachable
from kvpage.audit.runner import run_audit
from kvpage.cli import main
from tests.audit.raw_http import closing_front
from tests.audit.servers import MODEL, kvpage_server, proxy_app, serve_app

BODY = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def honest_url():
    with kvpage_server() as url:
        yield url


def config(url: str, **extra) -> AuditConfig:
    fields = dict(base_url=url, model=MODEL, progress=False, seed=26, block_sizes=(16,))
    return AuditConfig(**{**fields, **extra})


def test_a_request_dropped_on_a_kept_alive_connection_is_resent_on_a_fresh_one(honest_url):
    with closing_front(honest_url, per_connection=1) as (url, counts):
        budget = Budget(40)
        with AuditClient(config(url), budget) as client:
            answers = [client.post("/v1/completions", BODY, None)[0] for _ in range(6)]
            streamed = [
                client.post_stream("/v1/completions", {**BODY, "stream": True}, None)
                for _ in range(4)
            ]
    texts = {a["choices"][0]["text"] for a in answers}
    assert len(texts) == 1 and all(s.chunks for s in streamed)  # every answer arrived whole
    assert counts.dropped >= 3 and len(client.retries) == counts.dropped
    assert counts.received == counts.answered + counts.dropped
    assert all("without sending" in r["error"] or "Read" in r["error"] for r in client.retries)
    assert budget.used == 10 + len(client.retries)  # a resent request counts against the budget


def test_an_answer_cut_off_after_its_first_bytes_is_never_resent(honest_url):
    front = closing_front(honest_url, per_connection=5, cut_every=1)
    with front as (url, counts), AuditClient(config(url), Budget(10)) as client:
        with pytest.raises(ServerUnreachable):
            client.post("/v1/completions", BODY, None)
        with pytest.raises(ServerUnreachable, match="mid-stream"):
            client.post_stream("/v1/completions", {**BODY, "stream": True}, None)
    assert counts.received == 2 and counts.cut == 2 and client.retries == []


def test_a_whole_audit_through_a_connection_dropping_server_completes(honest_url, tmp_path):
    with closing_front(honest_url, per_connection=1) as (url, counts):
        report = tmp_path / "report"
        args = ["audit", "--base-url", url, "--model", MODEL, "--quiet", "--report", str(report)]
        args += ["--block-sizes", "16", "--probes", "3", "--suites", "baseline,prefix"]
        assert main(args) == 0
    data = json.loads((report / "report.json").read_text())
    assert data["exit_code"] == 0 and data["retries"] == counts.dropped > 0
    assert "retried on a fresh connection" in (report / "report.md").read_text()


def test_a_server_that_dies_mid_audit_is_a_finding_with_the_report_written(honest_url, tmp_path):
    """The front stops after 60 requests (the capabilities take ~15): a crash under sharing."""
    with closing_front(honest_url, per_connection=10**6, stop_after=60) as (url, counts):
        report = tmp_path / "report"
        args = ["audit", "--base-url", url, "--model", MODEL, "--quiet", "--report", str(report)]
        args += ["--block-sizes", "16", "--probes", "3"]
        assert main(args) == 1
    data = json.loads((report / "report.json").read_text())
    assert data["verdict"] == "SERVER FAILED UNDER CACHE SHARING"
    failure = data["server_failure"]
    assert failure["alive_after"] is False and failure["preceding_requests"]
    failed = [s for s in data["suites"].values() if s["verdict"] == SERVER_FAILED]
    assert len(failed) == 1 and failed[0]["name"] == failure["suite"]
    later = list(data["suites"])[list(data["suites"]).index(failure["suite"]) + 1 :]
    assert later and all(data["suites"][n]["verdict"] == "untestable" for n in later)
    assert "failed under cache sharing" in (report / "report.md").read_text()


def test_a_server_down_from_the_start_cannot_be_audited(tmp_path, capsys):
    with closing_front("http://127.0.0.1:9", per_connection=0) as (url, _):
        args = ["audit", "--base-url", url, "--model", MODEL, "--quiet"]
        assert main([*args, "--report", str(tmp_path / "r")]) == 2
    assert "ServerUnreachable" in capsys.readouterr().err


def test_run_audit_counts_no_retries_on_a_well_behaved_server(honest_url):
    result = run_audit(config(honest_url, suites=("baseline",), probes=2))
    assert result.retries == [] and result.to_json()["retries"] == 0


def test_5xx_answers_under_sharing_are_a_finding_with_what_preceded_them(honest_url):
    with serve_app(proxy_app(honest_url, fail_after=40)) as url:
        result = run_audit(config(url, suites=("baseline", "batch", "prefix"), probes=3))
    data = result.to_json()
    assert result.exit_code == 1 and data["verdict"] == "SERVER FAILED UNDER CACHE SHARING"
    errors = [e for s in data["suites"].values() for e in s["errors"] if e["status"] == 500]
    assert errors and all(e["preceding_requests"] for e in errors)
    assert any("failed with a 5xx" in f for f in data["findings"]["found"])
