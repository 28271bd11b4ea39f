"""The logit tolerance: relative to the logits' magnitude and to the rounding of the compute dtype
and the KV format; wide enough for rounding between two computation orders of the same model,
far too narrow for the smallest cache bug (a lost token of KV)."""

from __future__ import annotations

import pytest
import torch

from kvpage import SamplingParams
from kvpage.model import load_model
from kvpage.reference.generator import generate
from kvpage.reference.records import EMPTY_VIEW, StepRecord
from kvpage.verify.diff import logit_atol, logit_scale


def _rec(logits) -> StepRecord:
    t = None if logits is None else torch.tensor(logits)
    return StepRecord("r", 0, [5], [0], "", [], [], 0, EMPTY_VIEW, logits=t)


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tolerance_is_proportional_to_the_logits_magnitude(kv, dtype):
    one = logit_atol(kv, dtype, 1.0)
    assert logit_atol(kv, dtype, 30.0) == pytest.approx(30 * one)
    assert logit_atol(kv, dtype, 0.01) == one  # near-zero logits: the unit scale still holds


def test_the_coarser_rounding_decides():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert logit_atol("auto", f32) < logit_atol("bfloat16", f32) < logit_atol("int8", f32)
    assert logit_atol("int8", f32) < logit_atol("fp8_e4m3", f32)
    assert logit_atol("auto", f16) < logit_atol("auto", bf16)  # 3 more mantissa bits
    assert logit_atol("int8", bf16) == logit_atol("auto", bf16)  # bf16 compute is coarser
    assert logit_atol("fp8_e4m3", bf16) >= logit_atol("auto", bf16)


def test_logit_scale_is_the_largest_reference_logit():
    assert logit_scale([_rec([1.0, -7.5]), _rec([3.0, 2.0]), _rec(None)]) == 7.5
    assert logit_scale([_rec(None)]) == logit_scale([]) == 1.0


def _drift_and_bug(model_name: str, dtype: str) -> tuple[float, float, float]:
    """Incremental reference decode against one full forward pass of the same tokens (two
    computation orders), and against a full pass that lost the prompt's first token."""
    model, _ = load_model(model_name, dtype)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 256, (23,), generator=g).tolist()
    out = generate(model, prompt, SamplingParams(max_tokens=12, ignore_eos=True), trace_as="ref")
    ids = prompt + out.token_ids[:-1]
    steps = torch.stack(out.step_logits).float()
    full = model.forward_full(ids)[len(prompt) - 1 :].float()
    lost = model.forward_full(ids[1:])[len(prompt) - 2 :].float()
    scale = logit_scale(out.records)
    atol = logit_atol("auto", model.dtype, scale)
    return (steps - full).abs().max().item() / atol, (steps - lost).abs().max().item() / atol, scale


@pytest.mark.parametrize(
    "model_name,dtype",
    [
        ("builtin:passphrase-mini", "float32"),  # logits to ~30: a fixed 1e-4 was too tight
        ("builtin:tiny-llama", "float32"),
        ("builtin:tiny-qwen2", "float32"),
        ("builtin:tiny-llama", "bfloat16"),
    ],
)
def test_rounding_fits_the_tolerance_and_a_lost_token_does_not(model_name, dtype):
    rounding, bug, scale = _drift_and_bug(model_name, dtype)
    assert scale > 1.0
    assert rounding <= 0.5, f"rounding uses {rounding:.2f} of the tolerance"
    assert bug > 4, f"a lost token of KV moves logits by only {bug:.1f} tolerances"
