"""The layer-group part of the gate on builtin:tiny-hybrid: its suite passes on the engine, each
layer-group mutant is caught and attributed to layer_group with the group and first layer its
bug lives in; on a model with one group the mutants are not applicable; and the diff names the
group of a view that differs from the reference's windows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpage.model import load_model
from kvpage.reference.records import CacheView, GroupView, StepRecord, ViewEntry, make_record
from kvpage.verify.diff import first_divergence
from kvpage.verify.gate import run_gate
from kvpage.verify.mutants.layer_groups import LAYER_GROUP_MUTANTS

MODEL = "builtin:tiny-hybrid"  # layers 0, 1: window 12 (groups 1, 2); layer 2 global (group 0)
# Written out here: where each bug must be found (class, group, first layer).
EXPECTED = {
    "window_off_by_one": ("layer_group", 1, 0, "inside the window was given back"),
    "freed_inside_window": ("layer_group", 1, 0, "inside the window was given back"),
    "global_reads_local_table": ("layer_group", 1, 2, "a global layer reads a window-12 table"),
    "hit_reuses_blocks_outside_window": ("layer_group", 1, 0, "published for block"),
}


@pytest.fixture(scope="module")
def gate():
    return run_gate(
        MODEL,
        suites=("layer_groups",),
        mutants=[m.name for m in LAYER_GROUP_MUTANTS],
        progress=False,
        kv_cache_dtypes=(),
    )


def test_layer_group_suite_passes_on_the_engine(gate):
    assert [c.case for c in gate.cases if not c.passed] == []
    assert len(gate.cases) == 4
    stats = {c.case.split("/")[1]: c.stats for c in gate.cases}
    assert stats["long_decodes_free_window_blocks"]["window_frees"] > 0
    assert stats["prefix_across_window_edge"]["prefix_hits"] > 0
    assert stats["window_preemption_swap"]["swap_outs"] > 0


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_layer_group_mutant_is_caught_with_its_group_and_layer(gate, name):
    result = next(m for m in gate.mutants if m.mutant.name == name)
    assert result.caught, f"{name} escaped the suite"
    attribution = result.divergence["attribution"]
    cls, group, layer, reason = EXPECTED[name]
    assert attribution["class"] == cls and attribution["missing"] == []
    assert attribution["fields"]["group"] == group
    assert attribution["fields"]["first_layer"] == layer
    assert reason in attribution["reason"]


def test_layer_group_mutants_are_not_applicable_on_a_one_group_model():
    config = load_model("builtin:tiny-llama")[0].config
    assert all(m.not_applicable(config) for m in LAYER_GROUP_MUTANTS)
    hybrid = load_model(MODEL)[0].config
    assert not any(m.not_applicable(hybrid) for m in LAYER_GROUP_MUTANTS)


def _make(view: CacheView) -> StepRecord:
    """One decode step at position 20 choosing token 7, the same logits on both sides."""
    logits = torch.zeros(16)
    logits[7] = 1.0
    return make_record("r", 3, [5], [20], logits, 7, view)


def _entry(i: int) -> ViewEntry:
    return ViewEntry(i, 10 + i, 1, 8, False, 1, "private_writable")


def test_diff_names_the_group_whose_view_lacks_a_block_of_its_window():
    """Query at 20, window 12: keys 9..20, blocks 1, 2 of 8 tokens; group 2 lacks block 1."""
    ref_view = CacheView((), 3, "", 0, contiguous=True, layer_windows=(12, 12, None))
    entries = tuple(_entry(i) for i in range(3))
    good = GroupView(1, 12, (0,), 9, entries[1:], 20, (-1, -1))
    bad = GroupView(2, 12, (1,), 9, entries[2:], 20, (-1,))
    cand = CacheView(entries, 3, "", 8, groups=(good, bad))
    ref, candidate = _make(ref_view), _make(cand)
    found = first_divergence([ref], [candidate])
    assert found is not None and found.kind == "layer_group"
    fields = found.attribution.fields
    assert (found.attribution.cls, fields["group"], fields["first_layer"]) == ("layer_group", 2, 1)
    assert fields["needed_blocks"] == [1, 2] and fields["held_blocks"] == [2]
    whole = bad._replace(entries=entries[1:], published_at=(-1, -1))
    assert first_divergence([ref], [_make(dataclasses.replace(cand, groups=(good, whole)))]) is None
    # one block more than the window (block 0) is a view that differs too
    extra = bad._replace(entries=entries, published_at=(-1, -1, -1))
    found = first_divergence([ref], [_make(dataclasses.replace(cand, groups=(good, extra)))])
    assert found.attribution.reason.endswith("holds blocks outside its window")


# An all-windowed model (Mistral, window 24 on both layers): one window group 0, whose block_ids
# the engine trims. The trim mutants apply; a planted one is found in group 0 at layer 0.
TRIM_MUTANTS = ("window_off_by_one", "freed_inside_window")


@pytest.fixture(scope="module")
def all_window_gate(tmp_path_factory):
    from ..model.hf_models import save_hf

    directory = tmp_path_factory.mktemp("mistral-window")
    save_hf("mistral-window", directory)
    return run_gate(
        str(directory),
        suites=("layer_groups",),
        mutants=list(TRIM_MUTANTS),
        progress=False,
        kv_cache_dtypes=(),
    )


def test_all_window_suite_passes_and_frees(all_window_gate):
    gate = all_window_gate
    assert [c.case for c in gate.cases if not c.passed] == []
    stats = {c.case.split("/")[1]: c.stats for c in gate.cases}
    assert stats["long_decodes_free_window_blocks"]["window_frees"] > 0
    assert stats["prefix_across_window_edge"]["prefix_hits"] > 0


@pytest.mark.parametrize("name", TRIM_MUTANTS)
def test_all_window_trim_mutant_is_caught_in_group_0(all_window_gate, name):
    result = next(m for m in all_window_gate.mutants if m.mutant.name == name)
    assert result.caught, f"{name} escaped the suite"
    attribution = result.divergence["attribution"]
    assert attribution["class"] == "layer_group" and attribution["missing"] == []
    assert (attribution["fields"]["group"], attribution["fields"]["first_layer"]) == (0, 0)
    assert "inside the window was given back" in attribution["reason"]
    assert attribution["fields"]["window"] == 24


def test_only_the_trim_mutants_apply_to_an_all_window_model():
    import dataclasses as dc

    hybrid = load_model(MODEL)[0].config
    all_window = dc.replace(hybrid, layer_windows=(12, 12, 12))
    applies = [m.name for m in LAYER_GROUP_MUTANTS if not m.not_applicable(all_window)]
    assert applies == list(TRIM_MUTANTS)
