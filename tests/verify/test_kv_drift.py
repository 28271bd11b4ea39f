"""What quantized KV costs against unquantized KV, measured on gate prompts: int8
keeps at least 95% greedy agreement on the built-in models; `auto` measures no drift at all."""

from __future__ import annotations

import pytest

from kvpage.model import load_model
from kvpage.verify.kv_drift import gate_prompts, measure_drift


@pytest.mark.parametrize("model_name", ["builtin:tiny-llama", "builtin:tiny-gpt2"])
def test_int8_keeps_greedy_agreement_on_gate_prompts(model_name):
    model, _ = load_model(model_name)
    prompts = gate_prompts(model.config.vocab_size, ("preemption",))
    assert len(prompts) >= 20
    reports = measure_drift(model, ("auto", "int8"), prompts)
    auto, int8 = reports["auto"], reports["int8"]
    assert auto.tokens == int8.tokens == sum(n for _, n in prompts)
    assert auto.agreement == 1.0 and auto.max_logit_error < 1e-4  # teacher forcing is faithful
    assert int8.agreement >= 0.95, int8.summary()
    assert 0 < int8.max_logit_error < 1.0, int8.summary()  # quantized, and measurably so
