"""GPT-2's native kernels against transformers': LayerNorm (and its fused residual add) against
torch's nn.LayerNorm, gelu_new against transformers' NewGELUActivation; in bfloat16 each op
rounded where torch rounds it (equal but where another order of the row's sums, or another
tanh's last bit, survives the rounding: rarely), in float32 within a few ulps. The decode tape on GPT-2 against transformers:
tests/model/test_decode_tape.py."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import NewGELUActivation

from kvpage.model import native_small_ops
from kvpage.model.kernels import TORCH, finalize
from kvpage.model.layers import GPT2MLP, LayerNorm

pytestmark = pytest.mark.skipif(not native_small_ops.available(), reason="no C++ compiler")
EPS = 1e-5


def _norms(dtype: torch.dtype, c: int) -> tuple[LayerNorm, torch.nn.LayerNorm]:
    """Ours (natively bound) and torch's (transformers' GPT-2 uses nn.LayerNorm), one weight."""
    g = torch.Generator().manual_seed(c)
    w, b = 1 + 0.3 * torch.randn(c, generator=g), 0.2 * torch.randn(c, generator=g)
    ours, theirs = LayerNorm(c, eps=EPS), torch.nn.LayerNorm(c, eps=EPS)
    for norm in (ours, theirs):
        with torch.no_grad():
            norm.weight.copy_(w)
            norm.bias.copy_(b)
        norm.to(dtype).requires_grad_(False)
    return finalize(ours), theirs


def _rows(dtype: torch.dtype, n: int, c: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(n, c, generator=g) + 0.5).to(dtype)


@pytest.mark.parametrize("c", [7, 64, 250])  # 7: below a vector, 250: a tail after them
@pytest.mark.parametrize("rows", [1, 5, 700])  # 700 x 250: the kernel's threaded path
def test_layer_norm_is_torchs_in_bfloat16(rows, c):
    """One rounding at the end, as torch's; the row's mean and variance summed in another order
    change a bfloat16 output rarely (measured: 9 of 226,626 over these cases), by one rounding."""
    ours, theirs = _norms(torch.bfloat16, c)
    x = _rows(torch.bfloat16, rows, c)
    assert ours.native
    got, want = ours(x), theirs(x)
    assert float((got != want).float().mean()) < 1e-3
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)


@pytest.mark.parametrize("c", [7, 64, 250])
def test_layer_norm_is_torchs_in_float32(c):
    ours, theirs = _norms(torch.float32, c)
    x = _rows(torch.float32, 64, c)
    torch.testing.assert_close(ours(x), theirs(x), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_add_is_the_rounded_sum_and_its_norm(dtype):
    ours, theirs = _norms(dtype, 64)
    x = _rows(dtype, 4, 200, seed=1)[:, 10:74]  # a row-strided view
    delta = _rows(dtype, 4, 64, seed=2)
    total, normed = ours.add_forward(x, delta)
    assert torch.equal(total, x + delta)
    if dtype is torch.bfloat16:  # 256 values: equal (see above)
        assert torch.equal(normed, theirs(x + delta))
    else:
        torch.testing.assert_close(normed, theirs(x + delta), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_bound_modules_are_torchs_bit_for_bit(dtype):
    """Bound to torch's operators (the reference's twin, KVPAGE_NATIVE=0)."""
    ours, theirs = _norms(dtype, 64)
    finalize(ours, TORCH)
    x = _rows(dtype, 5, 64)
    assert not ours.native and torch.equal(ours(x), theirs(x))
    mlp = finalize(GPT2MLP(64, 256).to(dtype).requires_grad_(False), TORCH)
    h = mlp.fc(x)[0]
    assert not mlp.native and torch.equal(mlp._gelu_new(h), NewGELUActivation()(h))


@pytest.mark.parametrize("c", [300, 1013])  # a tail after the vectors
def test_gelu_new_is_transformers_in_bfloat16(c):
    """Every op rounded to bfloat16 as torch's chain rounds it; only tanh is another's (a few
    float32 ulps, rarely surviving the rounding)."""
    x = _rows(torch.bfloat16, 64, c, seed=4)
    got, want = native_small_ops.gelu_new(x), NewGELUActivation()(x)
    assert float((got != want).float().mean()) < 0.001
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)


@pytest.mark.parametrize("c", [300, 1013])
def test_gelu_new_is_transformers_in_float32(c):
    x = _rows(torch.float32, 64, c, seed=5)
    got, want = native_small_ops.gelu_new(x), NewGELUActivation()(x)
    # Near the cancellation in 1 + tanh (x < -4) a tanh ulp is all of a value below 1e-5.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=8e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_new_at_the_ends(dtype):
    """Where tanh is +-1, zeros, infinities and NaN; 32 lanes so that the vector loop takes them."""
    ends = [-100, -20, -9, -5.3, 0, -0.0, 1e-30, 5.3, 9, 20, 100]
    ends += [float("inf"), -float("inf"), float("nan")]
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.tensor(ends), 3 * torch.randn(32 - len(ends), generator=g)])
    x = x.to(dtype)[None]
    got, want = native_small_ops.gelu_new(x), NewGELUActivation()(x)
    step = 2e-7 if dtype is torch.float32 else 2**-7
    torch.testing.assert_close(got, want, atol=0, rtol=4 * step, equal_nan=True)
