"""widened_linear (int8 and bfloat16 weights widened to float32 a tile at a time) against float64
products of the same values, and the Projection paths that take it: int8 layers above the weight
kernel's rows, bfloat16 layers where oneDNN cannot pack them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpage.model import linear_kernels, native_gemv, widened
from kvpage.model.int8 import Int8Linear, quantize_per_channel
from kvpage.model.kernels import kernel_choice
from kvpage.model.projection import Projection
from kvpage.model.widened import widened_linear

K, N = 40, 50


def _oracle(x, weight, scales=None, bias=None) -> torch.Tensor:
    w = weight.double()
    if scales is not None:
        w = w * scales.double()[:, None]
    y = x.double() @ w.T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("rows", [1, 70])
def test_int8_codes_and_scales_give_the_dequantised_product(rows):
    torch.manual_seed(0)
    codes, scales = quantize_per_channel(torch.randn(N, K), torch.float32)
    x, bias = torch.randn(rows, K), torch.randn(N)
    got = widened_linear(x, codes, scales, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    torch.testing.assert_close(got.double(), _oracle(x, codes, scales, bias), rtol=1e-5, atol=1e-5)


def test_bfloat16_rounds_once_from_float32():
    torch.manual_seed(1)
    w, x, bias = (torch.randn(*s).bfloat16() for s in ((N, K), (3, 5, K), (N,)))
    got = widened_linear(x, w, None, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 5, N)
    exact = _oracle(x, w, None, bias)
    # float32 accumulation then one rounding: at most one bfloat16 step from the exact value's
    # own rounding (a sum near a rounding boundary may land on either side).
    step = exact.abs().clamp(min=1e-30) * 2.0**-7
    assert bool(((got.double() - exact).abs() <= step).all())


def test_a_weight_of_many_tiles_is_widened_a_tile_at_a_time(monkeypatch):
    torch.manual_seed(2)
    codes, scales = quantize_per_channel(torch.randn(N, K), torch.float32)
    x = torch.randn(6, K)
    widths = []
    honest = widened._widen

    def spy(tile, scales, start):
        widths.append((start, tile.shape[0]))
        return honest(tile, scales, start)

    monkeypatch.setattr(widened, "TILE_BYTES", 4 * K * 7)  # 7 rows: 8 tiles, the last of 1
    monkeypatch.setattr(widened, "_widen", spy)
    tiled = widened_linear(x, codes, scales)
    assert widths == [(s, min(7, N - s)) for s in range(0, N, 7)]
    want = _oracle(x, codes, scales)
    torch.testing.assert_close(tiled.double(), want, rtol=1e-5, atol=1e-5)


def test_a_float32_weight_is_not_scaled_in_place():
    w = torch.randn(N, K)
    before = w.clone()
    widened_linear(torch.randn(2, K), w, torch.full((N,), 3.0))
    assert torch.equal(w, before)


def _bound(*layers) -> Projection:
    proj = Projection(*layers)
    proj.bind_kernels(kernel_choice())  # chosen with the environment as the test set it
    return proj


def _int8_layers(bias: bool) -> list[Int8Linear]:
    torch.manual_seed(3)
    return [Int8Linear.from_linear(nn.Linear(K, n, bias=bias)) for n in (24, 8, 8)]


@pytest.mark.parametrize("bias", [True, False])
def test_int8_projection_above_the_kernel_rows_takes_the_widened_path(monkeypatch, bias):
    monkeypatch.setenv("KVPAGE_GEMV_MAX_ROWS", "0")  # no row count for the weight kernel
    layers = _int8_layers(bias)
    calls = []
    honest = linear_kernels.widened_linear
    monkeypatch.setattr(linear_kernels, "widened_linear", lambda *a: calls.append(1) or honest(*a))
    x = torch.randn(9, K)
    with torch.inference_mode():
        outs = _bound(*layers)(x)
    assert len(calls) == len(layers)
    for got, lin in zip(outs, layers, strict=True):
        codes, scales, b = lin.quantized_tensors()
        torch.testing.assert_close(got.double(), _oracle(x, codes, scales, b), rtol=1e-5, atol=1e-5)


def test_bfloat16_projection_that_onednn_cannot_pack_is_widened(monkeypatch):
    monkeypatch.setattr(native_gemv, "onednn_bf16", lambda: False)  # as on an AVX2 CPU
    monkeypatch.setenv("KVPAGE_GEMV_MAX_ROWS", "0")
    torch.manual_seed(4)
    layers = [nn.Linear(K, n).bfloat16() for n in (24, 8)]
    calls = []
    honest = linear_kernels.widened_linear
    monkeypatch.setattr(linear_kernels, "widened_linear", lambda *a: calls.append(1) or honest(*a))
    x = torch.randn(9, K).bfloat16()
    with torch.inference_mode():
        outs = _bound(*layers)(x)
    assert len(calls) == 2
    for got, lin in zip(outs, layers, strict=True):
        torch.testing.assert_close(got, honest(x, lin.weight, None, lin.bias), rtol=0, atol=0)
        torch.testing.assert_close(got, lin(x))  # bfloat16's default tolerance against torch
