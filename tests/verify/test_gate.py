"""The release gate on the real engine: every suite passes, every mutant is caught, and each
mutant's first divergence lands in the attribution class of its bug (R23, R24)."""

from __future__ import annotations

import json

import pytest

from kvpage.cli import main as cli_main
from kvpage.model import load_model
from kvpage.verify.gate import run_gate, run_mutant
from kvpage.verify.mutants import Mutant
from kvpage.verify.report import write_reports
from kvpage.verify.suites import Runtime, build_suites

# Written out here, not read from the mutants module: the test states what each bug should look
# like in the attribution matrix of seed 000 §8.
EXPECTED_CLASS = {
    "share_partial_no_cow": "block_table",
    "no_refcount": "block_table",
    "namespace_missing_field": "prefix_key",
    "block_key_own_tokens": "prefix_key",
    "fast_key_trusted": "prefix_key",
    "stale_index_after_evict": "prefix_key",
    "restore_visible_before_copy": "restore",
    "full_prefix_no_token_left": "prefix_key",
    "off_by_one_block_boundary": "block_table",
    "zero_length_cu_seqlens": "block_table",
}


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    result = run_gate("builtin:tiny-llama", progress=False)
    directory = tmp_path_factory.mktemp("gate")
    return result, write_reports(result, directory), directory


def test_gate_passes_on_the_engine(gate):
    result, data, _ = gate
    failed = [(c.case, [f.message for f in c.failures]) for c in result.cases if not c.passed]
    assert not failed
    assert data["passed"] is True and data["mutation_score"] == 1.0
    assert set(data["suites"]) == {"prefix", "batching", "preemption", "failure"}
    assert all(s["failures"] == 0 and s["cases"] > 0 for s in data["suites"].values())


@pytest.mark.parametrize("name", sorted(EXPECTED_CLASS))
def test_each_mutant_caught_and_attributed(gate, name):
    _, data, _ = gate
    m = data["mutants"][name]
    assert m["caught"], f"{name} escaped every suite"
    d = m["first_divergence"]
    assert d is not None, f"{name} was caught but showed no divergence: {m['first_failure']}"
    assert d["attribution"]["class"] == EXPECTED_CLASS[name], d["attribution"]
    assert d["attribution"]["missing"] == []
    assert d["reference"] is not None and d["candidate"] is not None
    assert d["candidate"]["view"]["entries"], "the candidate's block table is in the report"


def test_reports_are_written(gate):
    _, data, directory = gate
    assert json.loads((directory / "report.json").read_text())["passed"] is True
    md = (directory / "report.md").read_text()
    page = (directory / "report.html").read_text()
    assert "First divergence: mutant restore_visible_before_copy" in md
    assert "reference block table" in page and "candidate block table" in page
    assert "<script" not in page and "http" not in page  # self-contained


def test_an_uncaught_mutant_fails_the_gate():
    model, tok = load_model("builtin:tiny-llama")
    cases = build_suites(model.config.vocab_size, ("failure",))
    harmless = Mutant("harmless", "changes nothing", "block_table", lambda engine: None)
    base = Runtime(model, tok, "builtin:tiny-llama")
    result = run_mutant(harmless, model, tok, "builtin:tiny-llama", cases, base)
    assert not result.caught and result.divergence is None and not result.attribution_ok


def test_cli_exit_codes(tmp_path):
    assert (
        cli_main(
            ["verify", "--suite", "failure", "--no-mutants", "--quiet", "--report", str(tmp_path)]
        )
        == 0
    )
    assert (tmp_path / "report.json").is_file()
    assert cli_main(["verify", "--suite", "nope", "--quiet", "--report", str(tmp_path)]) == 2
