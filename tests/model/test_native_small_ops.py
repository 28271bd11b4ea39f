"""The native RMSNorm (with its residual add) and rotary kernels against the torch code they
replace and against float64: same roundings, only the sum of squares in another order."""

from __future__ import annotations

import pytest
import torch

from kvpage.model import native_small_ops
from kvpage.model.kernels import finalize
from kvpage.model.layers import RMSNorm, SwiGLU, _rotate_half, apply_rotary

pytestmark = pytest.mark.skipif(not native_small_ops.available(), reason="no C++ compiler")
DTYPES = [torch.float32, torch.bfloat16]


def _norm(dtype: torch.dtype, c: int = 96) -> RMSNorm:
    norm = RMSNorm(c, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(c, generator=torch.Generator().manual_seed(1)))
    return norm.to(dtype).requires_grad_(False)


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 700])  # 700 x 96: the kernel's threaded path
def test_rms_norm_matches_torch_and_float64(dtype, rows):
    norm = _norm(dtype)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = norm(x)
    want = norm._torch_forward(x)
    step = 1e-6 if dtype is torch.float32 else 2**-7  # a rounding of the output dtype
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=step)
    err = (got.double() - _rms64(x, norm.weight, norm.eps)).abs()
    assert float((err / _rms64(x, norm.weight, norm.eps).abs().clamp_min(1e-3)).max()) < 2 * step


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_forward_is_the_rounded_sum_and_its_norm(dtype):
    norm = _norm(dtype)
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 200, generator=gen).to(dtype)
    x = wide[:, 10:106]  # a row-strided view, as a fused projection's output is
    delta = torch.randn(4, 96, generator=gen).to(dtype)
    total, normed = norm.add_forward(x, delta)
    assert torch.equal(total, x + delta)  # one rounding of the sum, as torch's add
    torch.testing.assert_close(normed.float(), norm._torch_forward(x + delta).float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_equals_torch_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(3)
    n, h, kvh, d = 3, 4, 2, 16
    qkv = torch.randn(n, (h + 2 * kvh) * d, generator=gen).to(dtype)
    q = qkv[:, : h * d].view(n, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(n, kvh, d)
    angles = torch.randn(n, 1, d, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q = q * cos + _rotate_half(q) * sin
    want_k = k * cos + _rotate_half(k) * sin
    v_before = qkv[:, (h + kvh) * d :].clone()
    got_q, got_k = apply_rotary(q, k, cos, sin, native=True)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, (h + kvh) * d :], v_before)  # v, beside them, untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_in_place_equals_torch_bit_for_bit(dtype):
    """Phi-3's partial rotary factor: the first R of D values of each head rotate."""
    gen = torch.Generator().manual_seed(4)
    n, h, kvh, d, r = 3, 4, 2, 32, 16
    qkv = torch.randn(n, (h + 2 * kvh) * d, generator=gen).to(dtype)
    q = qkv[:, : h * d].view(n, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(n, kvh, d)
    angles = torch.randn(n, 1, r, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = apply_rotary(q.clone(), k.clone(), cos, sin)  # torch's
    got_q, got_k = apply_rotary(q, k, cos, sin, native=True)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_the_kernels_run_and_the_switch_turns_them_off(monkeypatch):
    norm = _norm(torch.float32)
    x = torch.randn(2, 96)
    calls = []
    real = native_small_ops.rms_norm
    monkeypatch.setattr(native_small_ops, "rms_norm", lambda *a: calls.append(1) or real(*a))
    norm(x)
    assert calls == []  # unbound: torch's
    finalize(norm)
    norm(x)
    assert calls == [1]
    monkeypatch.setenv("KVPAGE_NATIVE", "0")
    native_small_ops._library.cache_clear()
    try:
        finalize(norm)
        assert torch.equal(norm(x), norm._torch_forward(x)) and calls == [1]
    finally:
        monkeypatch.delenv("KVPAGE_NATIVE")
        native_small_ops._library.cache_clear()


def test_autograd_keeps_the_torch_path():
    norm = RMSNorm(96, 1e-6)
    x = torch.randn(2, 96, requires_grad=True)
    norm(x).sum().backward()  # the kernel has no backward: torch's path must have run
    assert x.grad is not None and norm.weight.grad is not None


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="weight"):
        native_small_ops.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-6)
    q = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="table"):
        native_small_ops.rotary_(q, q.clone(), torch.ones(2, 1, 10), torch.ones(2, 1, 10))
    with pytest.raises(ValueError, match="table"):  # an odd rotary width
        native_small_ops.rotary_(q, q.clone(), torch.ones(2, 1, 5), torch.ones(2, 1, 5))


class _GeluMLP(SwiGLU):
    activation = staticmethod(torch.nn.functional.gelu)


@pytest.mark.parametrize("kind", [SwiGLU, _GeluMLP])
def test_swiglu_takes_the_native_silu_mul_in_bfloat16_only(kind, monkeypatch):
    """A bfloat16 SwiGLU (a prefill chunk's rows) runs silu * up natively, as torch rounds it;
    float32 and a subclass with another activation keep torch's ops."""
    calls = []
    silu_mul = native_small_ops.silu_mul
    monkeypatch.setattr(native_small_ops, "silu_mul", lambda *a: calls.append(1) or silu_mul(*a))
    torch.manual_seed(0)
    mlp = kind(48, 80, bias=False).requires_grad_(False)
    x = torch.randn(37, 48)
    for dtype in DTYPES:
        mlp, x = finalize(mlp.to(dtype)), x.to(dtype)
        calls.clear()
        got = mlp(x)
        gate, up = x @ mlp.gate_proj.weight.t(), x @ mlp.up_proj.weight.t()
        want = (kind.activation(gate) * up) @ mlp.down_proj.weight.t()
        step = 2**-7 if dtype is torch.bfloat16 else 1e-6
        torch.testing.assert_close(
            got, want, rtol=4 * step, atol=4 * step * float(want.abs().max())
        )
        assert len(calls) == (kind is SwiGLU and dtype is torch.bfloat16)
