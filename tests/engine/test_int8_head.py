"""The LM head in int8 (EngineConfig.quantize_lm_head) in the engine: greedy tokens and logits
of the paged engine equal the contiguous reference on the same int8 weights (its own
dequantisation of every layer, the head included: kvpage.reference.weight_oracle) within
test_int8_weights' bound; batch-1 decode computes the head with the native int8 GEMV; a planted
head bug on either side is caught; and what the int8 head costs against float weights is
measured like the int8 body (kvpage.verify.weight_drift)."""

from __future__ import annotations

import pytest
import torch

from kvpage import LLM
from kvpage.model import linear_kernels, load_model, native_build, native_gemv
from kvpage.model.kernels import finalize
from kvpage.reference import weight_oracle
from kvpage.reference.generator import generate
from kvpage.verify.kv_drift import gate_prompts
from kvpage.verify.weight_drift import measure_weight_drift

from .test_int8_weights import BLOCK, GREEDY, MAX_TOKENS, TOLERANCE, _assert_matches
from .test_int8_weights import _engine_run as int8_engine_run
from .workload import prefix_prompts

CASES = [
    ("builtin:tiny-llama", "float32"),  # untied: lm_head itself becomes int8
    ("builtin:tiny-llama", "bfloat16"),
    ("builtin:tiny-qwen2", "float32"),
    ("builtin:tiny-gpt2", "float32"),  # tied: an int8 copy, the embedding stays float
]


def _engine_run(model, tokenizer, name: str, dtype: str, prompts, head: bool = True):
    return int8_engine_run(model, tokenizer, name, dtype, prompts, head)


def _max_error(rows, refs) -> float:
    return max(
        float((rows[(str(i), k)] - ref.step_logits[k]).abs().max())
        for i, ref in enumerate(refs)
        for k in range(MAX_TOKENS)
    )


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_int8_head_engine_equals_the_int8_reference(name, dtype):
    model, tokenizer = load_model(name, dtype, quantization="int8", quantize_lm_head=True)
    prompts = prefix_prompts(BLOCK, model.config.vocab_size, n=6)
    tokens, rows = _engine_run(model, tokenizer, name, dtype, prompts)
    for i, prompt in enumerate(prompts):
        _assert_matches(tokens[i], generate(model, prompt, GREEDY), rows, i, dtype)
    if dtype != "float32":
        return  # bfloat16: 127 levels are about its own 8-bit mantissa, no clear gap to test
    # ...and the head really is int8: the int8-body engine with a float head is apart.
    body, _ = load_model(name, dtype, quantization="int8")
    _, float_head = _engine_run(body, tokenizer, name, dtype, prompts[:1], head=False)
    head = torch.stack([rows[("0", k)] for k in range(MAX_TOKENS)])
    other = torch.stack([float_head[("0", k)] for k in range(MAX_TOKENS)])
    assert float((head - other).abs().max()) > 10 * TOLERANCE[dtype]


@pytest.mark.skipif(
    native_build.compiler() is None or not native_build.enabled(), reason="needs a C++ compiler"
)
def test_batch_one_decode_takes_the_native_int8_kernel_for_the_head(monkeypatch):
    llm = LLM("builtin:tiny-llama", quantization="int8", quantize_lm_head=True, num_blocks=32)
    vocab = llm.engine.model.config.vocab_size
    calls: list[tuple[int, int, torch.dtype]] = []
    original = native_gemv.WeightGemv.__call__

    def counting(self, x, out=None):
        calls.append((x.numel() // x.shape[-1], self.out_features, self.weight_dtype))
        return original(self, x, out)

    monkeypatch.setattr(native_gemv.WeightGemv, "__call__", counting)
    llm.generate([list(range(3, 20))], GREEDY, use_tqdm=False)
    head_calls = [(rows, w) for rows, out, w in calls if out == vocab]
    # one per sampled token (the prefill's last row, then each decode step), all on int8 codes
    assert head_calls == [(1, torch.int8)] * MAX_TOKENS
    llm.close()


def _shift_head(scales_of, vocab: int):
    """Scales shifted by one output channel, on the head (vocab outputs) only."""
    return [s.roll(1) if s is not None and s.shape[0] == vocab else s for s in scales_of]


def test_a_planted_head_bug_in_the_engine_is_caught(monkeypatch):
    name = "builtin:tiny-llama"
    model, tokenizer = load_model(name, quantization="int8", quantize_lm_head=True)
    vocab = model.config.vocab_size
    prompts = prefix_prompts(BLOCK, vocab, n=2)
    refs = [generate(model, p, GREEDY) for p in prompts]  # before the bug: the twin is cached
    honest = linear_kernels.widened_linear  # the engine's int8 path for many rows (prefill)
    monkeypatch.setattr(
        linear_kernels,
        "widened_linear",
        lambda x, c, s, b: honest(x, c, *_shift_head([s], vocab), b),
    )
    honest_kernel = native_gemv.WeightGemv.__init__

    def shifted(self, weights, scales, biases, x_dtype):
        honest_kernel(self, weights, _shift_head(scales, vocab), biases, x_dtype)

    monkeypatch.setattr(native_gemv.WeightGemv, "__init__", shifted)
    finalize(model)  # bound again: the kernels are built when bound (kvpage.model.kernels)
    _, rows = _engine_run(model, tokenizer, name, "float32", prompts)
    assert _max_error(rows, refs) > 100 * TOLERANCE["float32"]


def test_a_planted_head_dequantisation_bug_in_the_reference_is_caught(monkeypatch):
    name = "builtin:tiny-llama"
    model, tokenizer = load_model(name, quantization="int8", quantize_lm_head=True)
    vocab = model.config.vocab_size
    honest = weight_oracle.DequantizedLinear.__init__

    def shifted(self, layer):
        honest(self, layer)
        if layer.out_features == vocab:  # the head's scales on the wrong rows
            scales = layer.scales.float().roll(1)
            self.weight32 = layer.weight_int8.float() * scales[:, None]

    monkeypatch.setattr(weight_oracle.DequantizedLinear, "__init__", shifted)
    prompts = prefix_prompts(BLOCK, vocab, n=2)
    refs = [generate(model, p, GREEDY) for p in prompts]
    _, rows = _engine_run(model, tokenizer, name, "float32", prompts)
    assert _max_error(rows, refs) > 100 * TOLERANCE["float32"]


@pytest.mark.parametrize("model_name", ["builtin:tiny-llama", "builtin:tiny-gpt2"])
def test_int8_head_drift_against_float_weights_is_reported(model_name):
    plain, _ = load_model(model_name)
    body, _ = load_model(model_name, quantization="int8")
    full, _ = load_model(model_name, quantization="int8", quantize_lm_head=True)
    prompts = gate_prompts(plain.config.vocab_size, ("preemption",))[:12]
    body_report = measure_weight_drift(plain, body, prompts)
    report = measure_weight_drift(plain, full, prompts)
    assert report.weights == "int8+lm_head" and body_report.weights == "int8"
    assert report.summary()["weights"] == "int8+lm_head"
    assert report.tokens == sum(n for _, n in prompts)
    assert report.agreement >= 0.9, report.summary()
    assert 1e-3 < report.max_logit_error < 1.0, report.summary()
    assert report.errors != body_report.errors  # the head moved the logits further
