"""The kernel class (kvpage.verify.kernel_attribution): a bug in a fast path is caught against the
torch-only reference and, after the re-run with fast paths off, attributed to `kernel` naming the
path; a cache bug keeps its cache class (its re-run fails the same); a crash is a finding of its
own class with the engine step it happened in."""

from __future__ import annotations

import pytest

from kvpage.verify.gate import run_gate
from kvpage.verify.mutants import MUTANTS
from kvpage.verify.suites import crash_failure


@pytest.fixture(scope="module")
def gate(release_gate):
    """The default gate's mutants (tests/verify/conftest.py), the kernel ones among them."""
    return {m.mutant.name: m for m in release_gate.mutants}


@pytest.mark.parametrize(
    ("name", "path"),
    [("gemv_first_lane_unwritten", "gemv"), ("decode_plan_rope_swapped", "decode_plan")],
)
def test_a_fast_path_bug_is_named_by_its_path(gate, name, path):
    m = gate[name]
    assert m.caught and m.attribution_ok, (m.first_failure, m.attributed_class)
    attribution = m.divergence["attribution"]
    assert attribution["fields"]["paths"] == [path]
    assert attribution["fields"]["class_before"] != "kernel"  # what it read as before


def test_a_cache_bug_keeps_its_class(gate):
    m = gate["share_partial_no_cow"]
    assert m.caught and m.attributed_class == "block_table"


def test_kernel_mutants_plant_in_their_own_model():
    kernel = [m for m in MUTANTS if m.expected_class == "kernel"]
    assert kernel and all(m.own_model for m in kernel)


def test_a_crash_is_a_finding_with_its_step():
    class Engine:
        step_count = 7

    class Case:
        full_name = "suite/case"

    try:
        raise RuntimeError("boom")
    except RuntimeError as err:
        failure = crash_failure(err, Case(), Engine())
    attribution = failure.divergence.attribution
    assert attribution.cls == "crash" and not attribution.missing
    assert attribution.fields["step"] == 7 and "boom" in attribution.fields["error"]
    assert attribution.fields["raised_at"][-1].endswith("test_a_crash_is_a_finding_with_its_step")


def test_a_crash_mutant_is_caught_as_a_crash_with_its_step():
    result = run_gate("builtin:tiny-llama", suites=("stop",), progress=False, kv_cache_dtypes=(),
                      mutants=["stop_window_indexes_past_start"])  # fmt: skip
    [m] = result.mutants
    assert m.caught and m.attribution_ok, m.first_failure
    fields = m.divergence["attribution"]["fields"]
    assert fields["step"] >= 1 and fields["error"].startswith("IndexError")
    assert any("stop_reason" in frame for frame in fields["raised_at"])
