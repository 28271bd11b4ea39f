"""A mutant whose bug cannot be expressed on a model's shape is reported not applicable, with the
reason: not run, neither caught nor missed, and never silently dropped. The case in
point: one scale for all KV heads is each head's own scale on a model with one KV head."""

from __future__ import annotations

import pytest

import kvpage.verify.gate as gate
from kvpage.model import load_model
from kvpage.verify.mutants import MUTANTS
from kvpage.verify.mutants.layer_groups import LAYER_GROUP_MUTANTS
from kvpage.verify.report import markdown as report_markdown
from kvpage.verify.report import scores, summary_table
from tests.model.hf_models import save_hf

ONE_SCALE = next(m for m in MUTANTS if m.name == "one_scale_for_all_heads")


def test_one_scale_for_all_heads_needs_two_kv_heads(tmp_path):
    tiny, _ = load_model("builtin:tiny-llama", "float32")  # 2 KV heads
    assert ONE_SCALE.not_applicable(tiny.config) is None
    save_hf("llama-mqa", tmp_path)
    mqa, _ = load_model(str(tmp_path), "float32")
    assert "one KV head" in ONE_SCALE.not_applicable(mqa.config)
    # The layer-group mutants need global and window layers (tests/verify/test_layer_groups.py).
    others = [m for m in MUTANTS if m is not ONE_SCALE and m not in LAYER_GROUP_MUTANTS]
    assert all(m.not_applicable(mqa.config) is None for m in others)


@pytest.fixture(scope="module")
def mqa_gate(tmp_path_factory):
    """The gate on a one-KV-head model, its mutation check cut to two quantized mutants."""
    directory = tmp_path_factory.mktemp("mqa")
    save_hf("llama-mqa", directory)
    cut = (ONE_SCALE, next(m for m in MUTANTS if m.name == "int8_round_toward_zero"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gate, "MUTANTS", cut)
        return gate.run_gate(str(directory), suites=("prefix",), progress=False)


def test_the_gate_does_not_run_it_and_says_why(mqa_gate):
    by_name = {m.mutant.name: m for m in mqa_gate.mutants}
    assert set(by_name) == {"one_scale_for_all_heads", "int8_round_toward_zero"}
    na = by_name["one_scale_for_all_heads"]
    assert na.not_applicable and "one KV head" in na.not_applicable
    assert not na.caught and na.caught_by == [] and na.seconds == 0.0
    assert by_name["int8_round_toward_zero"].not_applicable is None
    assert by_name["int8_round_toward_zero"].caught
    assert mqa_gate.applicable == [by_name["int8_round_toward_zero"]]
    assert mqa_gate.mutation_score == 1.0 and mqa_gate.passed


def test_the_report_shows_it_as_not_applicable(mqa_gate):
    data = mqa_gate.to_dict()
    assert data["mutants"]["one_scale_for_all_heads"]["not_applicable"]
    assert "over 1 mutants (1 not applicable to this model)" in scores(data)
    row = next(r for r in summary_table(data).splitlines() if "one_scale_for_all_heads" in r)
    assert "n/a" in row and "one KV head" in row and "MISSED" not in row
    assert "n/a: the model has one KV head" in report_markdown(data)
