"""The release gate on the real engine: every suite passes, every mutant is caught, and each
mutant's first divergence lands in the attribution class of its bug."""

from __future__ import annotations

import json

import pytest

from kvpage.cli import main as cli_main
from kvpage.model import load_model
from kvpage.verify.gate import run_mutant
from kvpage.verify.mutants import Mutant
from kvpage.verify.mutants.base import MissingSeam, bind, plant
from kvpage.verify.report import write_reports
from kvpage.verify.suites import Runtime, build_suites

# Written out here, not read from the mutants module: the test states what each bug should look
# like in the attribution matrix.
EXPECTED_CLASS = {
    # cache and block table
    "share_partial_no_cow": "block_table",
    "fork_shares_partial_without_copy": "block_table",
    "no_refcount": "block_table",
    "namespace_missing_field": "prefix_key",
    "block_key_own_tokens": "prefix_key",
    "fast_key_trusted": "prefix_key",
    "stale_index_after_evict": "prefix_key",
    "restore_visible_before_copy": "restore",
    "full_prefix_no_token_left": "prefix_key",
    "off_by_one_block_boundary": "block_table",
    "zero_length_cu_seqlens": "block_table",
    # generations: tokens agree, KV provenance does not
    "free_without_generation_bump": "block_table",
    "reclaim_freed_tail": "restore",
    # sampling: same logits, another token
    "sampler_shared_generator": "sampling",
    "generator_reseeded_on_recompute": "sampling",
    "top_p_before_temperature": "sampling",
    "top_k_off_by_one": "sampling",
    # stop rules: one side runs longer
    "eos_not_a_stop": "stop_rule",
    "max_tokens_off_by_one": "stop_rule",
    "stop_one_token_late": "stop_rule",
    # resource paths and liveness: no token differs, memory or progress does
    "abort_keeps_swap_space": "resource",
    "abort_mid_prefill_leaks_blocks": "resource",
    "restore_needs_whole_remainder": "liveness",
    "held_swap_blocks_admission": "liveness",
    # namespaces and kill switches: a hit where none is allowed, or none where one is due
    "empty_salt_is_no_salt": "prefix_key",
    "tenant_switch_lookup_only": "prefix_key",
    "global_switch_lookup_only": "prefix_key",
    "tenant_switch_ignores_salt": "prefix_key",
    # cache policy and prefix accounting
    "fifo_eviction": "prefix_key",
    "digest_confirmed_at_root_only": "prefix_key",
    "hits_recounted_on_readmission": "accounting",
    "same_step_join": "prefix_key",
    # quantized KV: only the quantized run diverges
    "scale_from_previous_generation": "quantized_kv",
    "cow_copies_data_not_scale": "quantized_kv",
    "one_scale_for_all_heads": "quantized_kv",
    "swap_in_without_scales": "quantized_kv",
    "int8_round_toward_zero": "quantized_kv",
    # prompt logprobs: a hit for a request that needs every position's logits
    "prompt_rows_under_a_hit": "prefix_key",
    "prompt_rows_from_another_namespace": "prompt_logprobs",
    "prompt_rows_after_generation_change": "prompt_logprobs",
    "kept_prompt_rows_offset_by_one": "prompt_logprobs",
    # LoRA adapters
    "lora_left_out_of_namespace": "lora",
    "lora_keyed_by_name": "lora",
    "lora_name_in_salt_field": "lora",
    "lora_rows_shifted": "lora",
    "lora_wrong_scale": "lora",
    "lora_digest_skips_tensors": "lora",
    "lora_rslora_key_misspelled": "lora",
    "lora_slot_keeps_old_factors": "lora",
    "lora_int8_delta_times_scales": "lora",  # int8 weights only (INT8_WEIGHT_MUTANTS)
    "lora_pattern_last_key_wins": "lora",
    "lora_module_scale_ignored": "lora",
    # an adapter request's prompt rows from a pass without its adapter: its tokens are right
    "lora_prompt_rows_without_adapter": "prompt_logprobs",
    # structured outputs: a constrained request's token or end leaves its grammar's
    "mask_of_neighbouring_row": "structured",
    "matcher_not_replayed_after_recompute": "structured",
    "forks_share_one_matcher": "structured",
    "mask_after_top_k": "structured",
    "grammar_termination_ignored": "structured",
    "grammar_cache_keyed_by_name": "structured",
    # speculative decoding: a verified token, or KV a speculative step wrote, or a decision
    "published_before_roll_back": "speculative",
    "rejected_kv_left": "speculative",
    "slots_advanced_by_k": "speculative",
    "bonus_after_rejection": "speculative",
    "acceptance_without_min": "speculative",
    "resample_from_p": "speculative",
}
# Mutants bound to int8 weights (Mutant.weights): the release gate's float model never runs them
# (GatePlan.wants); a gate on int8 weights with their suites does, as the matrix's int8-weights
# cell (kvpage.verify.matrix.INT8_WEIGHTS).
INT8_WEIGHT_MUTANTS = {"lora_int8_delta_times_scales": ("lora",)}
STEP_PAIR_CLASSES = {"block_table", "prefix_key", "restore", "sampling", "quantized_kv"}
STEP_PAIR_CLASSES |= {"structured"}
SUITES = {
    "prefix",
    "batching",
    "preemption",
    "failure",
    "sampling",
    "stop",
    "resources",
    "namespaces",
    "policy",
    "parallel",
    "prompt_logprobs",
    "lora",
    "structured",
    "speculative",
    # the gate's default --kv-cache-dtype int8 copies
    "prefix:int8",
    "batching:int8",
    "preemption:int8",
    "parallel:int8",
}


@pytest.fixture(scope="module")
def gate(release_gate, tmp_path_factory):
    directory = tmp_path_factory.mktemp("gate")
    return release_gate, write_reports(release_gate, directory), directory


@pytest.fixture(scope="module")
def int8_weights_gate(tmp_path_factory):
    from kvpage.verify.gate import run_gate

    suites = tuple(sorted({s for names in INT8_WEIGHT_MUTANTS.values() for s in names}))
    result = run_gate(
        "builtin:tiny-qwen2",
        suites,
        mutants=tuple(INT8_WEIGHT_MUTANTS),
        progress=False,
        engine={"quantization": "int8"},
    )
    directory = tmp_path_factory.mktemp("gate_int8")
    return result, write_reports(result, directory), directory


def test_gate_passes_on_the_engine(gate):
    result, data, _ = gate
    failed = [(c.case, [f.message for f in c.failures]) for c in result.cases if not c.passed]
    assert not failed
    assert data["passed"] is True and data["mutation_score"] == 1.0
    assert set(data["suites"]) == SUITES
    assert set(data["mutants"]) >= set(EXPECTED_CLASS) - set(INT8_WEIGHT_MUTANTS)
    assert not set(data["mutants"]) & set(INT8_WEIGHT_MUTANTS)  # float weights: not run
    assert all(s["failures"] == 0 and s["cases"] > 0 for s in data["suites"].values())


def test_int8_weight_mutants_run_on_int8_weights(int8_weights_gate):
    result, data, _ = int8_weights_gate
    assert not [c.case for c in result.cases if not c.passed]
    assert set(data["mutants"]) == set(INT8_WEIGHT_MUTANTS)
    assert data["passed"] is True and data["mutation_score"] == 1.0


@pytest.mark.parametrize("name", sorted(EXPECTED_CLASS))
def test_each_mutant_caught_and_attributed(request, name):
    fixture = "int8_weights_gate" if name in INT8_WEIGHT_MUTANTS else "gate"
    _, data, _ = request.getfixturevalue(fixture)
    m = data["mutants"][name]
    assert m["caught"], f"{name} escaped every suite"
    d = m["first_divergence"]
    assert d is not None, f"{name} was caught but showed no divergence: {m['first_failure']}"
    assert d["attribution"]["class"] == EXPECTED_CLASS[name], d["attribution"]
    assert d["attribution"]["missing"] == []
    if EXPECTED_CLASS[name] in STEP_PAIR_CLASSES:
        assert d["reference"] is not None and d["candidate"] is not None
        assert d["candidate"]["view"]["entries"], "the candidate's block table is in the report"
    if EXPECTED_CLASS[name] == "quantized_kv":
        fields = d["attribution"]["fields"]
        assert fields["kv_dtype"] == "int8" and fields["kv_layout"]["version"] == 2
        assert fields["kv_scale"]["candidate"] and fields["kv_scale"]["reference"]
        assert d["candidate"]["view"]["kv_dtype"] == "int8"


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


@pytest.mark.parametrize(
    "plant_it",
    [
        lambda engine: plant(engine, "scheduler.no_such_seam", lambda self: None),
        lambda engine: bind(engine.scheduler, "_fail_if_stuck", lambda self, plan: None),
        lambda engine: bind(engine.scheduler, "no_such_method", lambda self: None),
    ],
    ids=["undeclared seam", "private method", "missing method"],
)
def test_a_mutant_that_cannot_be_planted_is_an_error_not_a_catch(plant_it):
    """Applied inside a case, a crash would count as caught: a seam that is gone must fail."""
    model, tok = load_model("builtin:tiny-llama")
    cases = build_suites(model.config.vocab_size, ("failure",))
    broken = Mutant("broken", "plants nothing", "block_table", plant_it)
    base = Runtime(model, tok, "builtin:tiny-llama")
    with pytest.raises(MissingSeam):
        run_mutant(broken, model, tok, "builtin:tiny-llama", cases, base)


def test_cli_exit_codes(tmp_path):
    assert (
        cli_main(
            ["verify", "--suite", "failure", "--no-mutants", "--quiet", "--report", str(tmp_path)]
        )
        == 0
    )
    data = json.loads((tmp_path / "report.json").read_text())
    # A skipped mutation check is reported as skipped, never as a vacuous 100%.
    assert data["mutation_score"] is None and data["attribution_score"] is None
    assert data["mutation_check"] == "skipped"
    for name in ("report.md", "report.html"):
        text = (tmp_path / name).read_text()
        assert "mutation check skipped" in text and "100%" not in text
    assert cli_main(["verify", "--suite", "nope", "--quiet", "--report", str(tmp_path)]) == 2
