"""Int8 weights (kvpage.model.int8, kvpage.model.quantize): the per-channel round trip is within
half a scale, the fused kernel computes what the explicit dequantisation does, the right layers
are quantized, and every misuse is a typed error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpage import LLM
from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.errors import InvalidConfig, UnsupportedQuantization
from kvpage.model import load_model
from kvpage.model.int8 import (
    QMAX,
    Int8Linear,
    check_supported,
    int8_matmul,
    quantize_per_channel,
    smallest_subnormal,
)
from kvpage.model.projection import Projection

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _weights(dtype: torch.dtype) -> torch.Tensor:
    """(out, in) rows of very different magnitudes (a scale per tensor would fail them) and an
    all-zero row."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=gen) * torch.logspace(-3, 1, 48)[:, None]
    w[7] = 0
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_within_half_a_scale_per_output_channel(dtype):
    w = _weights(dtype)
    codes, scales = quantize_per_channel(w, dtype)
    assert codes.dtype == torch.int8 and codes.shape == w.shape
    assert scales.dtype == dtype and scales.shape == (w.shape[0],)  # one per output channel
    s32 = scales.float()
    error = (w.float() - codes.float() * s32[:, None]).abs()  # (out, in)
    # Round to nearest: half a step, per channel (+ the float32 division's own rounding).
    assert bool((error <= s32[:, None] / 2 * (1 + 1e-6)).all()), float((error / s32[:, None]).max())
    # The scale is the row's max / 127, rounded up by at most one step of the dtype (a
    # subnormal step below the normals: float16 rows whose max is under 0.0078).
    tiny = smallest_subnormal(dtype)
    exact = (w.float().abs().amax(dim=1) / QMAX).clamp(min=tiny)
    assert bool((s32 >= exact).all())
    assert bool((s32 <= exact * (1 + 2 * torch.finfo(dtype).eps) + tiny).all())
    assert int(codes.abs().max()) <= QMAX
    normal = exact >= torch.finfo(dtype).tiny  # a normal scale: at most 1 ulp above exact
    assert int(normal.sum()) >= 40
    assert bool((codes[normal].abs().amax(dim=1) >= QMAX - 1).all())  # the range is used
    assert int(codes[7].abs().max()) == 0  # a zero row stays zero, no division by zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_equals_explicit_dequantisation(dtype):
    gen = torch.Generator().manual_seed(1)
    w = _weights(torch.float32)
    codes, scales = quantize_per_channel(w.to(dtype), dtype)
    x = torch.randn(2, 5, 96, generator=gen).to(dtype)  # (B, T, K): leading dims kept
    y = int8_matmul(x, codes, scales)
    assert y.shape == (2, 5, 48) and y.dtype == dtype
    expected = x.float() @ (codes.float() * scales.float()[:, None]).T
    # float32: the kernel scales after the sum, the oracle before: ~K ulps of the largest term.
    # bfloat16: the kernel accumulates in float32 and rounds once, so half a bf16 step (2^-8
    # relative) of the output, plus the float32 slack.
    rel = 1e-5 if dtype == torch.float32 else 2.0**-8
    bound = rel * expected.abs() + 1e-5 * expected.abs().max()
    assert bool(((y.float() - expected).abs() <= bound).all())


@pytest.mark.parametrize("model_name", ["builtin:tiny-llama", "builtin:tiny-gpt2"])
def test_decoder_linears_are_int8_and_embeddings_norms_head_are_not(model_name):
    plain, _ = load_model(model_name)
    model, _ = load_model(model_name, quantization="int8")
    int8 = {n for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    linears = {n for n, m in plain.named_modules() if type(m) is nn.Linear}
    assert int8 == linears - {"lm_head"} and int8
    for name, param in model.named_parameters():  # what stays float: embeddings, norms, head
        assert param.dtype == torch.float32, name
        assert not any(name.startswith(f"{q}.") for q in int8) or name.endswith(".bias"), name
    projections = [
        v for m in model.modules() for v in vars(m).values() if isinstance(v, Projection)
    ]
    assert sum(p.int8 for p in projections) == len(projections) - 1  # all but the head's
    head = model.logits.linears[0]
    assert not isinstance(head, Int8Linear)


def test_unknown_quantization_is_a_typed_config_error():
    for bad in ("int4", "INT8", "", None, 8):
        with pytest.raises(InvalidConfig, match="quantization"):
            EngineConfig(quantization=bad)
    with pytest.raises(InvalidConfig, match="quantization"):
        load_model("builtin:tiny-llama", quantization="fp4")
    with pytest.raises(InvalidConfig, match="quantization"):
        LLM("builtin:tiny-llama", quantization="int4")
    assert EngineConfig().quantization == "none"


def test_engine_refuses_a_model_that_is_not_what_the_config_says():
    plain, tok = load_model("builtin:tiny-llama")
    with pytest.raises(InvalidConfig, match="'none' weights"):
        LLMEngine(EngineConfig(quantization="int8", num_blocks=8), plain, tok)
    quantized, _ = load_model("builtin:tiny-llama", quantization="int8")
    with pytest.raises(InvalidConfig, match="'int8' weights"):
        LLMEngine(EngineConfig(num_blocks=8), quantized, tok)


def test_a_dtype_the_kernel_refuses_is_a_typed_error_not_a_float_fallback():
    with pytest.raises(UnsupportedQuantization, match="float64"):
        check_supported(torch.float64, "cpu")
    with pytest.raises(UnsupportedQuantization):  # at load, before any layer is swapped
        load_model("builtin:tiny-llama", torch.float64, quantization="int8")
    assert issubclass(UnsupportedQuantization, InvalidConfig)
    for dtype in DTYPES:
        check_supported(dtype, "cpu")
