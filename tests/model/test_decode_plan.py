"""The decode plan (kvpage.model.decode_plan) in the engine against Hugging Face transformers: every
decode step of a plain Llama-family model runs on it, and each generated token's logprob is the
HF model's for the same sequence; K and V planted into each other's pool on the plan's path are
caught by the same comparison. The models it must not take fall back to the modules; its kernels (the
KV-row write, silu * up, attention on strided q) against the torch code they stand for."""

from __future__ import annotations

import copy
import ctypes
import pickle

import pytest
import torch

from kvpage import LLM, SamplingParams
from kvpage.model import (
    decode_plan,
    load_model,
    native_attention,
    native_build,
    native_decode_step,
    native_small_ops,
)
from kvpage.model.decode_plan import LlamaDecodePlan
from kvpage.model.kernels import finalize
from kvpage.model.projection import Projection

from .hf_models import VOCAB, save_hf

pytestmark = pytest.mark.skipif(
    native_build.compiler() is None or not native_build.enabled(), reason="needs a C++ compiler"
)
TOKENS = 20
# fp32 logprobs through the plan vs HF's full forward: the GEMV's and SDPA's summation orders
# (measured <= 2e-5 on these models; tests/model/test_hf_parity.py's STEP_ATOL).
ATOL = 1e-4


def _prompts(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lengths = [1, 9, 23, *range(2, 2 + 2 * (n - 3), 2)][:n]
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in lengths]


@pytest.fixture
def plan_runs(monkeypatch) -> list[bool]:
    """Per call of LlamaDecodePlan.run: whether it computed the step."""
    runs: list[bool] = []
    run = LlamaDecodePlan.run

    def counted(self, x, rope, attn):
        hidden = run(self, x, rope, attn)
        runs.append(hidden is not None)
        return hidden

    monkeypatch.setattr(LlamaDecodePlan, "run", counted)
    return runs


@pytest.fixture
def one_call_runs(monkeypatch) -> list[int]:
    """Per call of FusedStep.run (the layers' calls from one native call): its row count."""
    runs: list[int] = []
    run = native_decode_step.FusedStep.run

    def counted(self, x, *args):
        runs.append(x.shape[0])
        return run(self, x, *args)

    monkeypatch.setattr(native_decode_step.FusedStep, "run", counted)
    return runs


def _engine(
    directory, hook: bool = False, n: int = 3, one_call: bool = True, **kw
) -> tuple[list[list[int]], list[list[float]]]:
    llm = LLM(str(directory), num_blocks=128, seed=0, debug_checks=True, **kw)
    plan = llm.engine.model.decode_plan()
    if plan is not None:
        plan.one_call = one_call
    if hook:  # a forward hook on one MLP: the plan would skip it
        llm.engine.model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    try:
        outs = [o.outputs[0] for o in llm.generate(_prompts(n), params, use_tqdm=False)]
    finally:
        llm.close()
    return [list(o.token_ids) for o in outs], [list(o.token_logprobs) for o in outs]


def _hf_error(hf_model, tokens: list[list[int]], logprobs: list[list[float]]) -> float:
    """Max |engine logprob - HF logprob| of the generated tokens; asserts greedy = HF's argmax."""
    worst = 0.0
    for prompt, out, lps in zip(_prompts(len(tokens)), tokens, logprobs, strict=True):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0].double()
        steps = logits[len(prompt) - 1 : -1].log_softmax(-1)  # (TOKENS, V)
        want = steps.gather(1, torch.tensor(out)[:, None])[:, 0]
        worst = max(worst, float((torch.tensor(lps, dtype=torch.float64) - want).abs().max()))
        if worst <= ATOL:
            assert out == steps.argmax(-1).tolist()
    return worst


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "python-loop"])
@pytest.mark.parametrize("name", ["llama-gqa-8q-2kv", "llama-tied", "qwen2-bias", "llama-mqa"])
def test_every_decode_step_runs_on_the_plan_and_matches_hf(
    name, one_call, tmp_path, plan_runs, one_call_runs
):
    hf_model = save_hf(name, tmp_path)
    tokens, logprobs = _engine(tmp_path, dtype="float32", one_call=one_call)
    # Three prompts prefilled together, then decode-only steps to the end: all on the plan,
    # and (the GEMV taking three rows in every dtype) all from one native call where asked.
    assert len(plan_runs) >= TOKENS - 1 and all(plan_runs)
    assert len(one_call_runs) == (len(plan_runs) if one_call else 0)
    err = _hf_error(hf_model, tokens, logprobs)
    assert err <= ATOL, f"{name}: logprob error {err:.3g} against HF on the decode plan"


@pytest.mark.parametrize("path", ["packed", "own-call", "copied-in"])
def test_rows_beyond_the_gemv_take_the_projections_own_path_on_the_plan(
    path, tmp_path, plan_runs, monkeypatch
):
    """24 sequences decoding together: float32 above the GEMV's row limit (16 on AVX2, 8 with
    AVX-512), so oneDNN's GEMM runs inside the plan and the next calls read its output where it
    lies; forced here: the Projection's own call instead (its q/k/v and gate/up outputs copied
    into the plan's buffers), and every output copied."""
    if path != "packed":
        monkeypatch.setattr(Projection, "packed_unchecked", lambda self, x: None)
    if path == "copied-in":
        monkeypatch.setattr(decode_plan, "_rows_like", lambda t, buffer: False)
    hf_model = save_hf("qwen2-bias", tmp_path)
    tokens, logprobs = _engine(tmp_path, n=24, dtype="float32")
    assert plan_runs and all(plan_runs)
    err = _hf_error(hf_model, tokens, logprobs)
    assert err <= ATOL, f"logprob error {err:.3g} against HF at 24 rows on the decode plan"


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "python-loop"])
def test_k_and_v_written_into_each_others_pool_on_the_plan_is_caught(
    one_call, tmp_path, plan_runs, one_call_runs, monkeypatch
):
    """The planted write swaps K and V: through PoolLayout.write_unchecked for the Python loop,
    and for the one native call through the entry point it calls (a ctypes callback of the
    kernel's signature in its place)."""
    hf_model = save_hf("llama-gqa-8q-2kv", tmp_path)
    if one_call:
        _plant_swapped_write_in_the_one_call(monkeypatch)
    else:
        honest = native_attention.PoolLayout.write_unchecked

        def swapped(self, layer, k, v, row_stride, slots, n):
            honest(self, layer, v, k, row_stride, slots, n)

        monkeypatch.setattr(native_attention.PoolLayout, "write_unchecked", swapped)
    tokens, logprobs = _engine(tmp_path, dtype="float32", one_call=one_call)
    assert plan_runs and all(plan_runs)
    assert bool(one_call_runs) == one_call
    assert _hf_error(hf_model, tokens, logprobs) > 100 * ATOL


def _plant_swapped_write_in_the_one_call(monkeypatch) -> None:
    honest = native_decode_step.kernels()
    write = native_attention.library().kvpage_paged_write
    i64, ptr = ctypes.c_int64, ctypes.c_void_p

    def swapped(dtype, k, v, src_stride, k_pool, v_pool, *rest):
        write(dtype, v, k, src_stride, k_pool, v_pool, *rest)

    callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ptr, ptr, i64, ptr, ptr, i64, i64, i64, ptr,
                                i64, i64, i64, i64)(swapped)  # fmt: skip
    planted = type(honest).from_buffer_copy(honest)
    planted.paged_write = ctypes.cast(callback, ptr).value
    planted.keep = callback  # alive while the engine runs
    monkeypatch.setattr(native_decode_step, "kernels", lambda: planted)


@pytest.mark.parametrize("name", ["mistral-window", "smollm3", "qwen3", "gemma3", "gpt2"])
def test_models_outside_the_plan_do_not_build_one(name, tmp_path):
    save_hf(name, tmp_path)
    model, _ = load_model(str(tmp_path))
    assert getattr(model, "decode_plan", lambda: None)() is None


@pytest.mark.parametrize("case", [{"kv_cache_dtype": "int8"}, {"hook": True}])
def test_steps_it_cannot_take_run_the_modules(case, tmp_path, plan_runs):
    hf_model = save_hf("llama-gqa-8q-2kv", tmp_path)
    tokens, logprobs = _engine(tmp_path, dtype="float32", **case)
    assert plan_runs == []
    if "hook" in case:  # the modules' path is as right as the plan's
        assert _hf_error(hf_model, tokens, logprobs) <= ATOL


def test_the_plan_off_by_environment(tmp_path, monkeypatch, plan_runs):
    monkeypatch.setenv("KVPAGE_DECODE_PLAN", "0")
    save_hf("llama-gqa-8q-2kv", tmp_path)
    _engine(tmp_path, dtype="float32")
    assert plan_runs == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_row_write_is_index_copy(dtype):
    g = torch.Generator().manual_seed(0)
    data = torch.randn(3, 2, 7, 4, 2, 16, generator=g).to(dtype)  # 3 layers, 7 blocks of 4
    qkv = torch.randn(3, (8 + 2 + 2) * 16, generator=g).to(dtype)
    k, v = qkv[:, 128:160].view(3, 2, 16), qkv[:, 160:].view(3, 2, 16)
    slots = torch.tensor([27, 0, 13])
    want = data.clone()
    want[1, 0].flatten(0, 1).index_copy_(0, slots, k)
    want[1, 1].flatten(0, 1).index_copy_(0, slots, v)
    layout = native_attention.PoolLayout.of(data)
    layout.write_unchecked(1, k.data_ptr(), v.data_ptr(), qkv.shape[1], slots.data_ptr(), 3)
    assert torch.equal(data, want)
    native_attention.check_slots(slots, 7, 4)
    with pytest.raises(IndexError):
        native_attention.check_slots(torch.tensor([28]), 7, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_torchs_silu_times_up(dtype):
    gate_up = (4 * torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(1))).to(dtype)
    gate, up = gate_up[:, :300], gate_up[:, 300:]
    got = native_small_ops.silu_mul(gate, up)
    want = torch.nn.functional.silu(gate) * up
    # exp's last bit may differ from torch's vectorised exp: one rounding of the dtype at most.
    step = 2e-7 if dtype is torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), atol=1e-30, rtol=2 * step)
    if dtype is torch.bfloat16:  # the float32 difference rarely survives rounding to 8 bits
        assert float((got != want).float().mean()) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_at_the_ends_of_exps_range(dtype):
    """Gates where e^-g overflows float32, comes close to its largest value (the kernel's 2^n
    would overflow on its own there), underflows, and NaN and infinities; 32 of them so that
    the vector loop takes them."""
    ends = [-100, -89, -88.7, -88.4, -87.5, -87.3, -20, 0, -0.0, 1e-30, 20, 87.4, 88.8, 100]
    ends += [float("inf"), -float("inf"), float("nan")]
    g = torch.Generator().manual_seed(3)
    gate = torch.cat([torch.tensor(ends), 3 * torch.randn(32 - len(ends), generator=g)])
    gate = gate.to(dtype)[None]
    up = torch.ones_like(gate)
    step = 2e-7 if dtype is torch.float32 else 2**-7
    got, want = native_small_ops.silu_mul(gate, up), torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(got, want, atol=0, rtol=2 * step, equal_nan=True)


def test_outputs_are_taken_as_they_lie_only_when_laid_out_as_the_buffer():
    buffer = torch.empty(3, 10)
    assert decode_plan._rows_like(torch.randn(3, 10), buffer)
    assert not decode_plan._rows_like(torch.randn(10, 3).t(), buffer)  # column-major
    assert not decode_plan._rows_like(torch.randn(3, 12)[:, :10], buffer)  # row stride 12
    assert not decode_plan._rows_like(torch.randn(3, 10).bfloat16(), buffer)
    assert not decode_plan._rows_like(torch.randn(4, 10), buffer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_reads_q_rows_of_a_fused_output(dtype):
    g = torch.Generator().manual_seed(2)
    k_pool, v_pool = torch.randn(2, 6, 4, 2, 32, generator=g).to(dtype)
    decode = native_attention.PagedDecode(
        torch.tensor([[3, 1], [5, 0]]), torch.tensor([7, 2]), 6, 4
    )
    qkv = torch.randn(2, 8 * 32 + 128, generator=g).to(dtype)
    q = qkv[:, : 8 * 32].view(2, 8, 32)
    out = torch.full((2, 8, 32), float("nan"), dtype=dtype)
    decode(q, k_pool, v_pool, 0.3, out=out)
    assert torch.equal(out, decode(q.contiguous(), k_pool, v_pool, 0.3))


def test_a_copy_of_the_model_builds_its_own_plan(tmp_path, plan_runs):
    """The reference's twins are deepcopies of the engine's model: a copy must not carry the
    original's plan (its modules, its kernel handles); finalized, it builds its own."""
    save_hf("llama-gqa-8q-2kv", tmp_path)
    _engine(tmp_path, dtype="float32", quantization="int8")  # the twin is made after decoding
    model, _ = load_model(str(tmp_path))
    plan = model.decode_plan()
    twin = copy.deepcopy(model)
    assert plan is not None and twin.decode_plan() is None
    finalize(twin)
    assert twin.decode_plan() is not plan and twin.decode_plan().blocks[0] is twin.model.layers[0]
    assert pickle.loads(pickle.dumps(model._plan)).plan is None
