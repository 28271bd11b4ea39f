"""Gemma 3's native kernels and its decode tape against Hugging Face transformers: the RMSNorm
with (1 + w) in float32 (and its residual add, and per head in place) against transformers'
Gemma3RMSNorm, GELU-tanh * up against torch's, and bfloat16 greedy tokens through the decode
tape against transformers' generate (float32 logprobs: tests/model/test_decode_tape.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from kvpage import LLM, SamplingParams
from kvpage.model import native_attention, native_small_ops
from kvpage.model.decode_tape import Tape
from kvpage.model.gemma3 import GemmaRMSNorm
from kvpage.model.kernels import TORCH, finalize

from .hf_models import VOCAB, save_hf

pytestmark = pytest.mark.skipif(not native_small_ops.available(), reason="no C++ compiler")
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def _norms(dtype: torch.dtype, c: int) -> tuple[GemmaRMSNorm, Gemma3RMSNorm]:
    """Ours (natively bound) and transformers', with one random weight."""
    w = 0.5 * torch.randn(c, generator=torch.Generator().manual_seed(c))
    ours, theirs = GemmaRMSNorm(c, EPS), Gemma3RMSNorm(c, eps=EPS)
    for norm in (ours, theirs):
        with torch.no_grad():
            norm.weight.copy_(w)
        norm.to(dtype).requires_grad_(False)
    return finalize(ours), theirs


def _rows(dtype: torch.dtype, n: int, c: int, seed: int = 0) -> torch.Tensor:
    return (3 * torch.randn(n, c, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("c", [7, 96, 250])  # 7: below a vector, 250: a tail after them
@pytest.mark.parametrize("rows", [1, 5, 700])  # 700 x 250: the kernel's threaded path
def test_the_native_norm_is_transformers_gemma_norm_in_bfloat16(rows, c):
    """Bit for bit: the row's sum of squares in another order changes no bfloat16 output
    here (one rounding at the end, as transformers rounds)."""
    ours, theirs = _norms(torch.bfloat16, c)
    x = _rows(torch.bfloat16, rows, c)
    assert ours.native and ours.offset_weight.dtype is torch.float32
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("c", [7, 96, 250])
def test_the_native_norm_is_transformers_gemma_norm_in_float32(c):
    """The same products; only the sum of squares (and so the scale) in another order."""
    ours, theirs = _norms(torch.float32, c)
    x = _rows(torch.float32, 64, c)
    torch.testing.assert_close(ours(x), theirs(x), atol=0, rtol=4e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_torch_path_is_transformers_gemma_norm_bit_for_bit(dtype):
    """Bound to torch's operators (the reference's twin, KVPAGE_NATIVE=0)."""
    ours, theirs = _norms(dtype, 96)
    finalize(ours, TORCH)
    assert not ours.native and ours.offset_weight is None
    x = _rows(dtype, 5, 96)
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_add_and_the_heads_are_the_norm_of_the_sum(dtype):
    ours, theirs = _norms(dtype, 32)
    wide = _rows(dtype, 4, 200, seed=1)
    x, delta = wide[:, 10:42], _rows(dtype, 4, 32, seed=2)  # x a row-strided view
    total, normed = ours.add_forward(x, delta)
    assert torch.equal(total, x + delta)
    heads = _rows(dtype, 3, 4 * 32, seed=3).view(3, 4, 32)
    want_heads = theirs(heads)
    got_heads = ours.heads_(heads)
    assert got_heads.data_ptr() == heads.data_ptr()  # in place
    if dtype is torch.bfloat16:
        assert torch.equal(normed, theirs(x + delta)) and torch.equal(got_heads, want_heads)
    else:
        torch.testing.assert_close(normed, theirs(x + delta), atol=0, rtol=4e-7)
        torch.testing.assert_close(got_heads, want_heads, atol=0, rtol=4e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", [300, 1013])  # a tail after the vectors
def test_gelu_tanh_mul_is_torchs_gelu_times_up(dtype, c):
    gate_up = _rows(dtype, 16, 2 * c, seed=4)
    gate, up = gate_up[:, :c], gate_up[:, c:]
    got = native_small_ops.gelu_tanh_mul(gate, up)
    want = F.gelu(gate, approximate="tanh") * up
    # tanh's last bits may differ from torch's (SLEEF's): a few float32 ulps before the
    # rounding to the dtype; where 1 + tanh nearly cancels (gate < -4) that is all of a
    # value below 1e-5.
    step = 2e-7 if dtype is torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=4 * step)
    if dtype is torch.bfloat16:  # the float32 difference rarely survives rounding to 8 bits
        assert float((got != want).float().mean()) < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_at_the_ends(dtype):
    """Where tanh is +-1 (|inner| > 8.66: gelu 0 or the gate itself), exp overflows or
    underflows, zeros, infinities and NaN; 32 lanes so that the vector loop takes them."""
    ends = [-100, -89, -20, -9, -5.3, 0, -0.0, 1e-30, 5.3, 9, 20, 100]
    ends += [float("inf"), -float("inf"), float("nan")]
    g = torch.Generator().manual_seed(3)
    gate = torch.cat([torch.tensor(ends), 3 * torch.randn(32 - len(ends), generator=g)])
    gate = gate.to(dtype)[None]
    up = torch.ones_like(gate)
    got, want = native_small_ops.gelu_tanh_mul(gate, up), F.gelu(gate, approximate="tanh")
    step = 2e-7 if dtype is torch.float32 else 2**-7
    torch.testing.assert_close(got, want, atol=0, rtol=4 * step, equal_nan=True)


def test_bfloat16_greedy_tokens_through_the_tape_are_transformers(tmp_path, monkeypatch):
    """Three prompts decoding together in bfloat16: every decode step after the first
    replays the tape (Gemma's three KV groups, global and local rotary tables), and the greedy
    tokens are transformers' generate's in bfloat16."""
    replays: list[int] = []
    replay = Tape.replay
    monkeypatch.setattr(Tape, "replay", lambda self: replays.append(1) or replay(self))
    hf_model = save_hf("gemma3", tmp_path).to(torch.bfloat16)
    assert hf_model.config.head_dim in native_attention.HEAD_DIMS
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 9, 23)]
    tokens = 16
    llm = LLM(str(tmp_path), num_blocks=128, seed=0, dtype="bfloat16", debug_checks=True)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    try:
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        tape = llm.engine.model.decode_plan()
    finally:
        llm.close()
    assert not tape.refused and len(tape.recorded()) == 1 and len(replays) == tokens - 2
    for prompt, got in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert got == want[0, len(prompt) :].tolist()
