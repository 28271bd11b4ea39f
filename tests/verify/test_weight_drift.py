"""What int8 weights cost against unquantized weights, measured on gate prompts (kv_drift's
method, kvpage.verify.weight_drift): the int8 built-in model keeps at least 90% greedy agreement
and moves logits measurably but by well under their scale; the float model against itself
measures no drift at all."""

from __future__ import annotations

from kvpage.model import load_model
from kvpage.verify.kv_drift import gate_prompts
from kvpage.verify.weight_drift import measure_weight_drift


def test_int8_weights_keep_greedy_agreement_on_gate_prompts():
    plain, _ = load_model("builtin:tiny-llama")
    quantized, _ = load_model("builtin:tiny-llama", quantization="int8")
    prompts = gate_prompts(plain.config.vocab_size, ("preemption",))[:12]
    control = measure_weight_drift(plain, plain, prompts)
    assert control.agreement == 1.0 and control.max_logit_error < 1e-4  # the method is faithful
    report = measure_weight_drift(plain, quantized, prompts)
    assert report.weights == "int8" and report.tokens == sum(n for _, n in prompts)
    assert report.agreement >= 0.9, report.summary()
    assert 1e-3 < report.max_logit_error < 1.0, report.summary()  # quantized, and measurably
