"""The gate's model stage (kvpage.verify.model_oracle): transformers on the same weights against
the reference's forward. Clean models pass in their served dtype and weight format; each planted
model-math bug is caught on its family's checkpoint, attributed to `model` with the first layer
that differs; a bug planted in the served model itself fails the served case."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpage.model import load_model
from kvpage.model.layers import RotaryEmbedding
from kvpage.verify.gate import run_gate
from kvpage.verify.model_oracle.mutants import MODEL_MUTANTS
from kvpage.verify.model_oracle.stage import lengths_for, run_model_stage
from kvpage.verify.mutants.base import replace


@pytest.mark.parametrize(
    ("name", "dtype", "quantization"),
    [
        ("builtin:tiny-llama", "float32", "none"),
        ("builtin:tiny-llama", "bfloat16", "none"),
        ("builtin:tiny-qwen2", "float32", "none"),
        ("builtin:tiny-qwen2", "bfloat16", "int8"),
        ("builtin:tiny-hybrid", "float32", "none"),
        ("builtin:tiny-gpt2", "float32", "int8"),
        ("builtin:passphrase-mini", "float32", "none"),
    ],
)
def test_served_models_match_transformers(name, dtype, quantization):
    model, _ = load_model(name, dtype, quantization=quantization)
    result = run_model_stage(model, name, mutants=False, families=())
    assert not result.not_applicable, result.not_applicable
    [served] = result.cases
    assert served.passed, served.failures[0].message


def test_a_tied_int8_head_copy_is_not_applicable_with_its_reason():
    model, _ = load_model("builtin:tiny-gpt2", quantization="int8", quantize_lm_head=True)
    result = run_model_stage(model, "builtin:tiny-gpt2", mutants=False, families=())
    assert result.cases == []
    assert "lm_head_int8" in result.not_applicable["model/served"]


def test_a_bug_in_the_served_model_fails_the_served_case():
    model, _ = load_model("builtin:tiny-qwen2")
    rotary = model.model.rotary
    wrong = RotaryEmbedding(dataclasses.replace(rotary.rope, theta=10000.0), model.config.head_dim)
    replace(model.model, "rotary", wrong)
    [served] = run_model_stage(model, "builtin:tiny-qwen2", mutants=False, families=()).cases
    assert not served.passed
    attribution = served.first_divergence.attribution
    assert attribution.cls == "model" and not attribution.missing
    assert attribution.fields["first_layer"] == "layer 0"
    assert attribution.fields["length"] > 1  # position 0 is not rotated: length 1 agrees


def test_every_model_mutant_is_caught_on_its_family_and_attributed():
    families = {m.family for m in MODEL_MUTANTS}
    model, _ = load_model("builtin:tiny-llama")
    result = run_model_stage(model, "builtin:tiny-llama", mutants=True, families=families)
    assert all(c.passed for c in result.cases), [c.case for c in result.cases if not c.passed]
    assert {o.mutant.name for o in result.mutants} == {m.name for m in MODEL_MUTANTS}
    for outcome in result.mutants:
        assert outcome.caught, outcome.mutant.name
        attribution = outcome.divergence["attribution"]
        assert attribution["class"] == "model" and not attribution["missing"]
        assert attribution["fields"]["first_layer"].startswith("layer ")


def test_lengths_reach_past_every_window():
    model, _ = load_model("builtin:tiny-hybrid")
    windows = [w for w in model.config.layer_windows if w is not None]
    assert max(lengths_for(model)) > 2 * max(windows)
    assert min(lengths_for(model)) == 1


def test_the_gate_runs_the_stage_first_and_counts_its_mutants():
    result = run_gate("builtin:tiny-llama", suites=(), progress=False, kv_cache_dtypes=(),
                      model_check="full", mutants=["nope_layers_inverted"])  # fmt: skip
    assert result.suites[0] == "model"
    assert result.cases[0].suite == "model" and result.cases[0].case == "served"
    [mutant] = result.mutants
    assert mutant.caught and mutant.attribution_ok and result.passed
    assert result.mutation_score == 1.0
    assert torch.get_num_threads() >= 1


def test_adapters_match_peft_and_a_wrong_merge_scale_is_caught(monkeypatch):
    import kvpage.reference.lora_merge as lora_merge

    model, _ = load_model("builtin:tiny-llama")
    clean = run_model_stage(model, "builtin:tiny-llama", mutants=False, families=(), adapters=True)
    assert [c.case for c in clean.cases] == ["served", "lora:a", "lora:b", "lora:rs", "lora:qv"]
    assert all(c.passed for c in clean.cases), [
        c.failures[0].message for c in clean.cases if c.failures
    ]

    def no_rslora(config: dict) -> float:
        return config.get("lora_alpha", config["r"]) / config["r"]

    monkeypatch.setattr(lora_merge, "adapter_scale", no_rslora)
    broken = run_model_stage(model, "builtin:tiny-llama", mutants=False, families=(), adapters=True)
    failed = [c.case for c in broken.cases if not c.passed]
    assert failed == ["lora:rs"]  # only the rsLoRA adapter's scale depends on use_rslora
    assert broken.cases[3].first_divergence.attribution.cls == "model"


@pytest.mark.parametrize("mutant", MODEL_MUTANTS, ids=lambda m: m.name)
def test_verify_model_dir_fails_on_each_family_bug(tmp_path, mutant):
    """`kvpage verify --model <that family's dir>`: the served case alone sees the bug (the
    engine cases cannot: the reference runs the same model code)."""
    from kvpage.verify.model_oracle.families import save_family

    save_family(mutant.family, tmp_path)
    model, _ = load_model(str(tmp_path))
    clean = run_model_stage(model, str(tmp_path), mutants=False, families=())
    assert clean.cases[0].passed
    mutant.apply(model)
    [served] = run_model_stage(model, str(tmp_path), mutants=False, families=()).cases
    assert not served.passed and served.first_divergence.attribution.cls == "model"
