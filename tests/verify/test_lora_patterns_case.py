"""The lora suite's newer cases: an adapter with per-module ranks and alphas (rank_pattern,
alpha_pattern) and prompt logprobs of adapter requests. The verifier writes the pattern adapter
as PEFT would and hashes it by the recipe; each of the three bugs on these paths is caught by
its own case alone and attributed to its class."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvpage.engine.engine import LLMEngine
from kvpage.lora.adapter import load_peft_adapter
from kvpage.model import load_model
from kvpage.verify.cases.lora import PAT, lora_cases
from kvpage.verify.lora_adapters import write_peft
from kvpage.verify.mutants.lora import LORA_MUTANTS
from kvpage.verify.suites import Runtime, run_case

MODEL = "builtin:tiny-llama"
PATTERN_CASE = "an adapter with per-module ranks and alphas (rank_pattern, alpha_pattern)"
ROWS_CASE = "prompt logprobs with adapters, then served from each adapter's kept rows"


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL)


def test_the_pattern_adapter_is_written_with_per_module_ranks(loaded, tmp_path):
    """Files as PEFT writes them (the patterns in the spec's order), each module's factors at
    its own rank, read by the engine's loader to the verifier's digest; the same patterns in
    another order are another adapter (digest and identity)."""
    model, _ = loaded
    written = write_peft(PAT, model.config, tmp_path / "pat")
    config = json.loads(Path(written.path, "adapter_config.json").read_text())
    assert list(config["rank_pattern"]) == [k for k, _ in PAT.rank_pattern]
    adapter = load_peft_adapter("pat", written.path, model.config, PAT.max_rank)
    assert adapter.digest == written.digest
    ranks = {where: a.shape[0] for where, (a, _) in adapter.weights.items()}
    assert ranks[1, "v_proj"] == 6 and ranks[0, "v_proj"] == 3 and ranks[0, "down_proj"] == 8
    assert ranks[0, "q_proj"] == 2 and adapter.rank == 8
    assert adapter.scale_of((0, "q_proj")) == 24 / 2 and adapter.scale_of((1, "q_proj")) == 1 / 2
    assert adapter.scale_of((1, "v_proj")) == 4 / 6
    swapped = replace(PAT, alpha_pattern=tuple(reversed(PAT.alpha_pattern)))
    other = write_peft(swapped, model.config, tmp_path / "swapped")
    again = load_peft_adapter("pat", other.path, model.config, PAT.max_rank)
    assert other.digest != written.digest and again.digest == other.digest
    assert again.scale_of((0, "q_proj")) == 1 / 2  # the general key first: it wins


@pytest.mark.parametrize(
    ("name", "case", "cls"),
    [
        ("lora_pattern_last_key_wins", PATTERN_CASE, "lora"),
        ("lora_module_scale_ignored", PATTERN_CASE, "lora"),
        ("lora_prompt_rows_without_adapter", ROWS_CASE, "prompt_logprobs"),
    ],
)
def test_each_new_lora_bug_is_caught_by_its_case_alone(loaded, name, case, cls):
    """Every older lora case passes the bug; its own case fails it, the first divergence in
    its class with every field the class requires."""
    model, tokenizer = loaded
    mutant = next(m for m in LORA_MUTANTS if m.name == name)
    assert mutant.expected_class == cls

    def factory(cfg):
        engine = LLMEngine(cfg, model, tokenizer)
        mutant.apply(engine)
        return engine

    runtime = Runtime(model, tokenizer, MODEL, engine_factory=factory)
    results = {c.name: run_case(c, runtime) for c in lora_cases(model.config.vocab_size)}
    assert [n for n, r in results.items() if not r.passed] == [case]
    first = results[case].first_divergence
    assert first is not None and first.attribution.cls == cls
    assert first.attribution.missing == []
    if cls == "prompt_logprobs":  # an adapter request's rows, and they are the base model's
        assert first.request_id in ("rows.a", "rows.b")
        assert "the rows are the base model's" in first.attribution.reason
