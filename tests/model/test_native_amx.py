"""The AMX bfloat16 linear (kvpage.model.native_amx) against a float64 oracle and oneDNN's AMX
GEMM (the same bits), and where Projection and the decode plan take it: bfloat16 inputs of
3-32 rows, its own copy of the weights kept current.
Runs where torch reports AMX tiles and the kernel builds (a Sapphire Rapids or later Xeon);
elsewhere the kernel does not exist and these rows go to oneDNN, which other tests cover."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpage import LLM, SamplingParams
from kvpage.model import native_amx
from kvpage.model.decode_tape import Tape
from kvpage.model.native_amx import AmxLinear
from kvpage.model.projection import Projection

from .hf_models import VOCAB, save_hf
from .kernel_calls import count_rows

pytestmark = pytest.mark.skipif(not native_amx.available(), reason="needs AMX tiles")


def _oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def _assert_rounded_sum(y: torch.Tensor, x, w, b) -> None:
    """y within one bfloat16 rounding (2^-8 relative) plus float32 accumulation error of the
    exact sum."""
    exact = _oracle(x, w, b)
    magnitude = x.double().abs() @ w.double().abs().T
    bound = exact.abs() * 2**-8 + magnitude * x.shape[-1] * 2**-24 + 1e-30
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max()):.3g}"


@pytest.mark.parametrize("rows", [1, 3, 7, 16, 17, 31, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_is_the_exact_sum_rounded_once(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    n, k = 96, 160
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    _assert_rounded_sum(AmxLinear(w, b)(x), x, w, b)


def test_rows_a_stride_apart_and_an_output_buffer():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 64, generator=g).bfloat16()
    wide = torch.randn(5, 128, generator=g).bfloat16()
    x = wide[:, 32:96]  # rows 128 apart: copied to contiguous rows by __call__
    out = torch.empty(5, 64, dtype=torch.bfloat16)
    y = AmxLinear(w, None)(x, out)
    assert y is out
    _assert_rounded_sum(y, x, w, None)
    y2 = torch.empty(5, 64, dtype=torch.bfloat16)
    AmxLinear(w, None).run_unchecked(wide.data_ptr() + 64, 128, 5, y2.data_ptr(), 2)
    assert torch.equal(y2, y)  # the raw call reads the strided rows where they lie


@pytest.mark.parametrize("n,k,rows", [(1280, 768, 5), (768, 2048, 17), (4096, 768, 32)])
def test_it_sums_as_onednns_amx_gemm(n, k, rows):
    """oneDNN's bfloat16 GEMM on AMX (torch's prepacked linear, what these rows ran before) walks
    K in the same 32-value tile steps: the outputs are the same bits."""
    g = torch.Generator().manual_seed(n + rows)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    assert torch.equal(AmxLinear(w, b)(x), onednn)


@pytest.mark.parametrize("shape", [(48, 64), (64, 48)])
def test_shapes_off_the_tile_grid_are_refused(shape):
    assert not native_amx.fits(*shape)
    with pytest.raises(ValueError, match="multiples of 32"):
        AmxLinear(torch.zeros(shape, dtype=torch.bfloat16), None)


def test_more_rows_than_one_pass_are_refused():
    linear = AmxLinear(torch.zeros(32, 32, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="1 to 32"):
        linear(torch.zeros(native_amx.MAX_ROWS + 1, 32, dtype=torch.bfloat16))


def test_projection_takes_it_at_decode_rows_only(monkeypatch):
    rows = count_rows(monkeypatch, AmxLinear)
    torch.manual_seed(0)
    q, k = nn.Linear(64, 64, bias=True).bfloat16(), nn.Linear(64, 32, bias=True).bfloat16()
    proj = Projection(q, k)
    with torch.inference_mode():
        for m in (1, 2, 3, 32, 33, 200):
            x = torch.randn(m, 64).bfloat16()
            yq, yk = proj(x)
            _assert_rounded_sum(yq, x, q.weight, q.bias)
            _assert_rounded_sum(yk, x, k.weight, k.bias)
    assert rows == [3, 32]


def test_an_in_place_weight_update_repacks(monkeypatch):
    rows = count_rows(monkeypatch, AmxLinear)
    lin = nn.Linear(64, 64, bias=False).bfloat16()
    proj = Projection(lin)
    x = torch.randn(8, 64).bfloat16()
    with torch.inference_mode():
        proj(x)
    with torch.no_grad():
        lin.weight.mul_(-2)
    with torch.inference_mode():
        (y,) = proj(x)
    assert rows == [8, 8]
    _assert_rounded_sum(y, x, lin.weight, None)


def _engine_logprobs(directory, prompts: list[list[int]]) -> tuple[list, list, list[int]]:
    """bfloat16 greedy decode of all prompts together: tokens, their logprobs, and per step of
    the replayed decode tape the number of its linear kernel calls that were AMX kernels."""
    llm = LLM(str(directory), dtype="bfloat16", num_blocks=128, seed=0, debug_checks=True)
    amx_per_step: list[int] = []
    run = Tape.replay

    def counted(self):
        amx = native_amx.library().kvpage_amx_run
        amx_per_step.append(sum(fn is amx for fn, _ in self.calls))
        return run(self)

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Tape, "replay", counted)
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()
    return [list(o.token_ids) for o in outs], [list(o.token_logprobs) for o in outs], amx_per_step


def _error_against(hf_model, prompts, tokens, logprobs) -> float:
    """Mean |engine logprob - the float32 HF model's| over the engine's own decoded tokens (the
    first comes from the prefill, which neither path changes)."""
    errors = []
    for prompt, out, lps in zip(prompts, tokens, logprobs, strict=True):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0].double()
        want = logits[len(prompt) - 1 : -1].log_softmax(-1).gather(1, torch.tensor(out)[:, None])
        errors.append((torch.tensor(lps, dtype=torch.float64) - want[:, 0]).abs()[1:])
    return float(torch.cat(errors).mean())


def test_a_bfloat16_engine_decodes_on_it_no_further_from_float32_than_onednn(tmp_path, monkeypatch):
    """Five sequences decoding together: every step's projections on the AMX kernel, from the
    replayed decode tape; the logprobs against HF's float32 forward of the same
    (bfloat16-representable) weights no worse than with the kernel off (oneDNN's AMX GEMM at 5
    rows)."""
    hf_model = save_hf("llama-gqa-8q-2kv", tmp_path)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.copy_(p.bfloat16().float())
    hf_model.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 8, 13, 21, 5)]
    tokens, logprobs, amx_steps = _engine_logprobs(tmp_path, prompts)
    layers = hf_model.config.num_hidden_layers
    assert amx_steps and all(n == 4 * layers for n in amx_steps)
    on = _error_against(hf_model, prompts, tokens, logprobs)
    monkeypatch.setenv("KVPAGE_AMX", "0")
    tokens_off, logprobs_off, amx_off = _engine_logprobs(tmp_path, prompts)
    assert not any(amx_off)
    off = _error_against(hf_model, prompts, tokens_off, logprobs_off)
    assert on <= max(1.5 * off, 2e-2), f"AMX {on:.3g} vs oneDNN {off:.3g} against float32"
    # Both sum each output's products on the same tile instruction in the same K order, and
    # round once: the same bits (test_it_sums_as_onednns_amx_gemm does), so the same decode.
    assert (tokens, logprobs) == (tokens_off, logprobs_off)
