"""`kvpage audit` from the command line: exit 0 clean, 1 on a finding, 2 when the audit cannot
be carried out (bad option, unreachable server, rejected key), one `error:` line and no
traceback; the request budget is a hard cap."""

from __future__ import annotations

import json

import pytest

from kvpage.cli import main
from kvpage.server.background import free_port
from tests.audit.servers import KEYS, MODEL, kvpage_server

FAST = ["--block-sizes", "16", "--probes", "3", "--canary-group", "3", "--timing-trials", "5"]


@pytest.fixture(scope="module")
def tenant_url():
    with kvpage_server(api_keys=KEYS) as url:
        yield url


def audit(url: str, tmp_path, *extra: str) -> int:
    report = str(tmp_path / "report")
    return main(
        ["audit", "--base-url", url, "--model", MODEL, "--quiet", "--report", report, *extra]
    )


def test_clean_server_exits_0_and_writes_the_reports(tenant_url, tmp_path, capsys):
    keys = ["--api-key", "key-alice", "--second-api-key", "key-bob"]
    assert audit(tenant_url, tmp_path, *keys, *FAST, "--suites", "baseline,canaries,timing") == 0
    out = capsys.readouterr().out
    assert "timing" in out and "isolated" in out and "exit 0" in out
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["exit_code"] == 0 and set(data["suites"]) == {"baseline", "canaries", "timing"}
    assert (tmp_path / "report" / "report.html").exists()


def test_a_leak_exits_1(tmp_path):
    with kvpage_server(api_keys=KEYS, mutant="namespace_missing_field") as url:
        keys = ["--api-key", "key-alice", "--second-api-key", "key-bob"]
        assert audit(url, tmp_path, *keys, *FAST, "--suites", "timing") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--api-key", "wrong"], "AuthFailed: HTTP 401"),
        ([], "AuthFailed: HTTP 401"),  # keyed server, no key
        (["--api-key", "key-alice", "--second-api-key", "nope"], "--second-api-key"),
    ],
)
def test_rejected_keys_exit_2(tenant_url, tmp_path, capsys, args, message):
    assert audit(tenant_url, tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_unreachable_server_and_bad_options_exit_2(tmp_path, capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    assert audit(dead, tmp_path) == 2
    assert "ServerUnreachable" in capsys.readouterr().err
    assert audit("localhost:8000", tmp_path) == 2
    assert "not an http(s)://host[:port] URL" in capsys.readouterr().err
    assert audit(dead, tmp_path, "--block-sizes", "16,x") == 2
    assert "--block-sizes" in capsys.readouterr().err
    assert audit(dead, tmp_path, "--suites", "prefix,nope") == 2
    assert "unknown suite" in capsys.readouterr().err
    assert audit(dead, tmp_path, "--model-pairs", "0") == 2
    assert "--model-pairs" in capsys.readouterr().err


def test_unauditable_setups_exit_2(tenant_url, tmp_path, capsys):
    keys = ["--api-key", "key-alice"]
    assert audit(tenant_url, tmp_path, *keys, "--second-api-key", "key-alice") == 2
    assert "must differ from --api-key" in capsys.readouterr().err
    assert audit(tenant_url, tmp_path, *keys, "--budget-requests", "5") == 2
    assert "before the server's capabilities are known" in capsys.readouterr().err
    wrong = ["audit", "--base-url", tenant_url, "--model", "no-such-model", "--quiet", *keys]
    assert main([*wrong, "--report", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "ServerIncompatible" in err and "no-such-model" in err


def test_the_budget_is_a_hard_cap(tenant_url, tmp_path):
    keys = ["--api-key", "key-alice", "--second-api-key", "key-bob"]
    code = audit(tenant_url, tmp_path, *keys, "--budget-requests", "40")
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["requests"] <= 40
    notes = " ".join(data["plan_notes"])
    assert "to fit the request budget" in notes
    untested = [u for s in data["suites"].values() for u in s["untested"]]
    assert any("budget" in u for u in untested)  # what did not run says why
    assert code == 0


def test_every_run_has_fresh_prompts_unless_a_seed_is_given(tenant_url, tmp_path):
    keys = ["--api-key", "key-alice", "--suites", "baseline", "--probes", "2"]
    seeds = []
    for run in range(2):
        audit(tenant_url, tmp_path / str(run), *keys)
        data = json.loads((tmp_path / str(run) / "report" / "report.json").read_text())
        seeds.append(data["seed"])
    assert seeds[0] != seeds[1]
    audit(tenant_url, tmp_path / "fixed", *keys, "--seed", "42")
    assert json.loads((tmp_path / "fixed" / "report" / "report.json").read_text())["seed"] == 42


def test_keys_can_come_from_the_environment(tenant_url, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPAGE_AUDIT_API_KEY", "key-alice")
    monkeypatch.setenv("KVPAGE_AUDIT_SECOND_API_KEY", "key-bob")
    assert audit(tenant_url, tmp_path, *FAST, "--suites", "timing") == 0
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["suites"]["timing"]["data"]["second_tenant"] == "second API key"
    assert "key-alice" not in (tmp_path / "report" / "report.json").read_text()
