"""How far int8 weights move a model from its unquantized weights: kv_drift's question for the
weights, on the same gate prompts and with the same teacher forcing (kvpage.verify.kv_drift).
The engine with int8 weights must equal the int8 reference; this measures what the quantization
itself costs.

For each prompt the unquantized model generates greedily (the contiguous reference); then the
prompt plus those tokens go once through the int8 model as the engine computes it (the fused
kernel), so every position is judged on the same context. A model whose LM head is int8 too
(EngineConfig.quantize_lm_head) is reported as weights "int8+lm_head"."""

from __future__ import annotations

import torch

from kvpage.model.base import CausalLM
from kvpage.model.quantize import head_quantized, weight_quantization
from kvpage.reference.generator import generate
from kvpage.sampling_params import SamplingParams
from kvpage.verify.kv_drift import DriftReport


@torch.inference_mode()
def measure_weight_drift(
    plain: CausalLM, quantized: CausalLM, prompts: list[tuple[list[int], int]]
) -> DriftReport:
    """`plain` and `quantized`: the same model and dtype, unquantized and quantized."""
    head = "+lm_head" if head_quantized(quantized) else ""
    report = DriftReport("auto", weights=weight_quantization(quantized) + head)
    for prompt, max_tokens in prompts:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        expected = generate(plain, prompt, params)
        logits = quantized.forward_full(prompt + expected.token_ids[:-1])  # (T, V)
        forced = logits[len(prompt) - 1 :].float().cpu()  # (n, V): predicting each token
        report.add(forced, torch.stack(expected.step_logits), expected.token_ids)
    return report
