"""The KV formats (issue 14): config validation, the quantise -> dequantise round trip's rules
(per-head float16 scales, round half to even, error bounds), and the engine's quantiser against
the reference's independent implementation (kvpage.verify.kv_oracle)."""

from __future__ import annotations

import pytest
import torch

from kvpage import LLM
from kvpage.config import EngineConfig
from kvpage.errors import InvalidConfig
from kvpage.model.kv_format import (
    PLAIN_LAYOUT,
    SCALE_MIN,
    SCALED_LAYOUT,
    dequantize,
    kv_format,
    quantize,
)
from kvpage.verify.kv_oracle import RoundTrip


@pytest.mark.parametrize("bad", ["int4", "fp8", "float8_e4m3fn", "", "INT8"])
def test_unknown_kv_cache_dtype_is_refused_with_the_choices(bad):
    with pytest.raises(InvalidConfig, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(InvalidConfig, match="fp8_e4m3"):
        LLM("builtin:tiny-llama", kv_cache_dtype=bad)


def test_formats():
    f32 = torch.float32
    auto, bf16 = kv_format("auto", f32), kv_format("bfloat16", f32)
    int8, fp8 = kv_format("int8", f32), kv_format("fp8_e4m3", f32)
    assert (auto.name, auto.layout_version, auto.quantized, auto.cast_only) == (
        "float32", PLAIN_LAYOUT, False, False
    )
    assert (bf16.name, bf16.layout_version, bf16.cast_only) == ("bfloat16", PLAIN_LAYOUT, True)
    assert (int8.name, int8.layout_version, int8.qmax) == ("int8", SCALED_LAYOUT, 127.0)
    assert (fp8.name, fp8.layout_version, fp8.qmax) == ("float8_e4m3fn", SCALED_LAYOUT, 448.0)
    assert kv_format("auto", torch.bfloat16).name == "bfloat16"
    assert not kv_format("bfloat16", torch.bfloat16).cast_only  # the model's own dtype


def test_int8_rounds_half_to_even_with_one_scale_per_head():
    # head 0: max 127 -> scale exactly 1.0, codes are round(x); head 1: max 254 -> scale 2.0
    x = torch.tensor([[[0.5, 1.5, 2.5, -0.5, -1.5, 126.6, 127.0, 3.2],
                       [1.0, 3.0, 5.0, -1.0, 2.6, 0.0, 254.0, -254.0]]])  # (1, KVH=2, D=8)
    codes, scales = quantize(x, kv_format("int8", torch.float32))
    assert scales.dtype == torch.float16 and scales.tolist() == [[1.0, 2.0]]
    assert codes.dtype == torch.int8
    assert codes[0, 0].tolist() == [0, 2, 2, 0, -2, 127, 127, 3]
    assert codes[0, 1].tolist() == [0, 2, 2, 0, 1, 0, 127, -127]
    back = dequantize(codes, scales, torch.float32)
    assert back[0, 1].tolist() == [0.0, 4.0, 4.0, 0.0, 2.0, 0.0, 254.0, -254.0]


def test_zero_vector_gets_a_finite_scale_and_dequantises_to_zero():
    for name in ("int8", "fp8_e4m3"):
        codes, scales = quantize(torch.zeros(3, 2, 16), kv_format(name, torch.float32))
        assert torch.all(scales.float() == SCALE_MIN)
        assert torch.equal(dequantize(codes, scales, torch.float32), torch.zeros(3, 2, 16))


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_round_trip_error_is_bounded_by_the_format(name):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=gen) * torch.logspace(-3, 2, 64)[:, None, None]
    codes, scales = quantize(x, kv_format(name, torch.float32))
    back = dequantize(codes, scales, torch.float32)
    s = scales.float().unsqueeze(-1)
    err = (back - x).abs()
    if name == "int8":  # half a code step, whatever the scale's float16 rounding did
        assert torch.all(err <= s / 2 * (1 + 1e-6))
    else:  # e4m3: 3 mantissa bits (half an ulp = 1/16 relative), subnormal step 2^-9
        assert torch.all(err <= s * ((x / s).abs() / 16 + 2.0**-10) * (1 + 1e-6))
    assert err.max() > 0  # the round trip is not the identity


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "bfloat16", "auto"])
def test_engine_quantiser_equals_the_reference_round_trip_bitwise(name):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 2, 16, generator=gen) * 3
    trip, trip_scales = RoundTrip(name).apply(x)
    fmt = kv_format(name, torch.float32)
    if fmt.quantized:
        codes, scales = quantize(x, fmt)
        assert torch.equal(scales, trip_scales)
        assert torch.equal(dequantize(codes, scales, torch.float32), trip)
    else:
        assert trip_scales is None
        assert torch.equal(x.to(fmt.storage_dtype).to(torch.float32), trip)


def test_truncation_is_not_rounding():
    """The int8_round_toward_zero mutant changes codes (so it can be caught at all)."""
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(2))
    fmt = kv_format("int8", torch.float32)
    assert not torch.equal(quantize(x, fmt)[0], quantize(x, fmt, torch.trunc)[0])
