"""The LoRA cases: an honest engine passes them (each adapter request equal to the reference's
own merge, the hit counts exact); each LoRA mutant is caught, first divergence in the lora class
with its fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpage.engine.engine import LLMEngine
from kvpage.lora.adapter import load_peft_adapter
from kvpage.model import load_model
from kvpage.reference.lora_merge import merged_model, read_adapter
from kvpage.verify.cases.lora import A_RELOADED, QV, RS, A, lora_cases
from kvpage.verify.diff import REQUIRED_FIELDS
from kvpage.verify.lora_adapters import AdapterFiles, peft_config, write_peft
from kvpage.verify.mutants.lora import LORA_MUTANTS
from kvpage.verify.suites import Runtime, run_case

from .test_reference_independence import reached_modules

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL)


def test_honest_engine_passes_every_lora_case(loaded):
    model, tokenizer = loaded
    runtime = Runtime(model, tokenizer, MODEL)
    cases = lora_cases(model.config.vocab_size)
    assert len(cases) == 8
    stats = {}
    for case in cases:
        result = run_case(case, runtime)
        assert result.failures == [], (case.name, [f.message for f in result.failures])
        stats[case.name] = result.stats
    preempted = stats[
        "adapters preempted by recompute and swap, a parallel request with an adapter"
    ]
    assert preempted["preemptions"] >= 2


def test_the_adapters_change_what_the_model_says(loaded):
    """Else every LoRA case would pass an engine that ignores adapters."""
    model, tokenizer = loaded
    runtime = Runtime(model, tokenizer, MODEL)
    case = lora_cases(model.config.vocab_size)[0]
    outs = {s.request_id: runtime.reference(s, 8).token_ids for s in case.requests}
    assert len({tuple(outs[r]) for r in ("base.1", "a.1", "b.1")}) == 3


@pytest.mark.parametrize("mutant", LORA_MUTANTS, ids=lambda m: m.name)
def test_each_lora_mutant_is_caught_in_the_lora_class(loaded, mutant):
    """On the weights its bug lives in (Mutant.weights: int8 for the delta scaled by the weight
    scales; float otherwise)."""
    weights = {} if mutant.weights is None else {"quantization": mutant.weights}
    model, tokenizer = load_model(MODEL, **weights) if weights else loaded

    def factory(cfg):
        engine = LLMEngine(cfg, model, tokenizer)
        mutant.apply(engine)
        return engine

    runtime = Runtime(model, tokenizer, MODEL, engine_factory=factory, engine=weights)
    results = [run_case(c, runtime) for c in lora_cases(model.config.vocab_size)]
    divergences = [r.first_divergence for r in results if r.first_divergence is not None]
    assert divergences, f"{mutant.name} was not caught"
    attribution = divergences[0].attribution
    assert attribution.cls == mutant.expected_class and attribution.missing == []
    assert set(REQUIRED_FIELDS[mutant.expected_class]) <= set(attribution.fields)


def test_written_adapters_load_through_the_engines_loader_with_the_verifiers_digest(loaded):
    """The suite's adapters are PEFT directories; the engine's loader reads them to the
    verifier's own digest, and a reload that changes only tensor bytes gets another one."""
    model, _ = loaded
    files = AdapterFiles(model.config)
    a, again = files(A), files(A_RELOADED)
    assert Path(a.path, "adapter_config.json").is_file()
    assert Path(a.path, "adapter_model.safetensors").is_file()
    assert peft_config(A) == peft_config(A_RELOADED) and a.digest != again.digest
    for written in (a, again, files(RS), files(QV)):
        adapter = load_peft_adapter(written.spec.name, written.path, model.config, 8)
        assert adapter.digest == written.digest and adapter.identity == written.identity
    rs = load_peft_adapter("rs", files(RS).path, model.config, 8)
    assert rs.scale == pytest.approx(16 / 8**0.5)


def test_the_digest_check_fails_a_digest_that_skips_the_tensor_bytes(loaded):
    model, tokenizer = loaded
    runtime = Runtime(model, tokenizer, MODEL)
    reload = lora_cases(model.config.vocab_size)[1]
    mutated = _mutant_runtime(loaded, "lora_digest_skips_tensors")
    found = [f for f in run_case(reload, mutated).failures if f.kind == "adapter"]
    kinds = {f.divergence.kind for f in found}
    assert kinds == {"adapter_digest", "adapter_reload"}, [f.message for f in found]
    assert all(f.divergence.attribution.cls == "lora" for f in found)
    assert all(f.divergence.attribution.missing == [] for f in found)
    assert not [f for f in run_case(reload, runtime).failures if f.kind == "adapter"]


def test_the_new_lora_bugs_are_caught_only_by_their_cases(loaded):
    """rsLoRA read from another key and a stale slot get past every older case: the rsLoRA
    case and the slot-reuse case are what catch them."""
    model, _ = loaded
    cases = {c.name: c for c in lora_cases(model.config.vocab_size)}
    rs_case, reuse_case = (
        cases["an rsLoRA adapter with alpha != rank"],
        cases["one adapter slot reused by an adapter with fewer targets"],
    )
    for name, case in (
        ("lora_rslora_key_misspelled", rs_case),
        ("lora_slot_keeps_old_factors", reuse_case),
    ):
        runtime = _mutant_runtime(loaded, name)
        caught = [c.name for c in cases.values() if not run_case(c, runtime).passed]
        assert caught == [case.name], (name, caught)


def test_the_reference_reads_the_scale_from_the_config_itself(loaded, tmp_path):
    model, _ = loaded
    written = write_peft(RS, model.config, tmp_path / "rs")
    config, scale, factors, _ = read_adapter(written.path)
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, 16.0, True)
    assert scale == pytest.approx(16 / 8**0.5)
    merged = merged_model(model, written.path)
    a, b = factors[(0, "q_proj")]
    delta = (
        merged.model.layers[0].self_attn.q_proj.weight
        - model.model.layers[0].self_attn.q_proj.weight
    )
    assert torch.allclose(delta, scale * (b @ a), atol=1e-5)
    cfg_path = Path(written.path, "adapter_config.json")
    cfg_path.write_text(json.dumps({**config, "use_rslora": False}))
    assert read_adapter(written.path)[1] == pytest.approx(2.0)
    cfg_path.write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        read_adapter(written.path)


def test_the_reference_reads_adapters_with_no_engine_code():
    reached = reached_modules("kvpage.reference.lora_merge")
    assert "kvpage.model.loader" in reached  # the walk works
    bad = sorted(
        n for n in reached if n.startswith(("kvpage.lora", "kvpage.engine", "kvpage.cache"))
    )
    assert not bad, bad


def _mutant_runtime(loaded, name: str) -> Runtime:
    model, tokenizer = loaded
    mutant = next(m for m in LORA_MUTANTS if m.name == name)

    def factory(cfg):
        engine = LLMEngine(cfg, model, tokenizer)
        mutant.apply(engine)
        return engine

    return Runtime(model, tokenizer, MODEL, engine_factory=factory)
