"""Projection: fused, prepacked linears bound once (kvpage.model.kernels) must compute what the
separate nn.Linear layers compute, and serve a weight changed after binding once bound again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvpage.model import linear_kernels, projection
from kvpage.model.kernels import kernel_choice
from kvpage.model.projection import Projection

pytestmark = pytest.mark.skipif(not projection.onednn_available(), reason="torch without oneDNN")


def _layers(bias: bool, dtype=torch.float32) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(32, n, bias=bias).to(dtype) for n in (48, 16, 16)]


def _bound(*layers) -> Projection:
    proj = Projection(*layers)
    proj.bind_kernels(kernel_choice())
    return proj


def _expected(layers, x):
    return [F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
            for lin in layers]  # fmt: skip


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fused_outputs_equal_the_separate_linears(bias, rows):
    layers = _layers(bias)
    x = torch.randn(rows, 32)
    with torch.inference_mode():
        outs = _bound(*layers)(x)
    assert [o.shape for o in outs] == [(rows, 48), (rows, 16), (rows, 16)]
    for got, want in zip(outs, _expected(layers, x), strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_bfloat16_is_packed_too():
    layers = _layers(True, torch.bfloat16)
    x = torch.randn(9, 32).bfloat16()
    with torch.inference_mode():
        outs = _bound(*layers)(x)
    for got, lin in zip(outs, layers, strict=True):
        torch.testing.assert_close(got, lin(x))  # bfloat16's default tolerance


@pytest.mark.parametrize("rows", [4, 64])  # the weight GEMV's rows and oneDNN's
def test_an_in_place_weight_update_is_served_once_bound_again(rows):
    layers = _layers(True)
    proj = _bound(*layers)
    x = torch.randn(rows, 32)
    with torch.inference_mode():
        before = proj(x)[1].clone()
    with torch.no_grad():
        layers[1].weight.mul_(-1.0)
        layers[2].bias.add_(1.0)
    proj.bind_kernels(kernel_choice())
    with torch.inference_mode():
        after = proj(x)
    torch.testing.assert_close(after[1].double(), _expected(layers, x)[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after[2].double(), _expected(layers, x)[2], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(before, after[1])


def test_a_replaced_parameter_or_dtype_is_served_once_bound_again():
    layers = _layers(False)
    proj = _bound(*layers)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        proj(x)
    layers[0].weight = nn.Parameter(torch.zeros_like(layers[0].weight))  # e.g. tie_weights
    proj.bind_kernels(kernel_choice())
    with torch.inference_mode():
        assert proj(x)[0].abs().max() == 0
    for lin in layers:
        lin.to(torch.bfloat16)
    proj.bind_kernels(kernel_choice())
    with torch.inference_mode():
        out = proj(x.bfloat16())
    assert out[1].dtype == torch.bfloat16
    torch.testing.assert_close(out[1], layers[1](x.bfloat16()))


def test_training_goes_through_autograd():
    layers = _layers(True)
    proj = _bound(*layers)
    x = torch.randn(4, 32)
    sum(o.sum() for o in proj(x)).backward()
    assert all(lin.weight.grad is not None and lin.bias.grad is not None for lin in layers)


def test_a_tied_embedding_is_a_head():
    emb = nn.Embedding(100, 32)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        (logits,) = _bound(emb)(x)
    torch.testing.assert_close(logits, x @ emb.weight.T, atol=1e-5, rtol=1e-5)


def test_a_linear_kernel_is_one_entry_of_the_table(monkeypatch):
    """A kernel added to linear_kernels.LINEAR_KERNELS alone is bound and runs at its rows, in
    the table's order (docs/architecture.md: adding a linear kernel)."""
    rows_seen = []

    def bind(layers):
        weight, bias = layers.concatenated()

        def run(x):
            rows_seen.append(x.shape[0])
            return layers.split(F.linear(x, weight, bias))

        return linear_kernels.Bound("planted", 2, 5, run)

    planted = linear_kernels.LinearKernel("planted", bind, lambda: True, (None, ""))
    monkeypatch.setattr(linear_kernels, "LINEAR_KERNELS", (planted, *linear_kernels.LINEAR_KERNELS))
    layers = _layers(True)
    proj = _bound(*layers)
    with torch.inference_mode():
        for rows in (1, 3, 5, 6):
            x = torch.randn(rows, 32)
            for got, want in zip(proj(x), _expected(layers, x), strict=True):
                torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert rows_seen == [3, 5]
