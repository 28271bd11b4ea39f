"""The decode tape (kvpage.model.decode_tape) in the engine against Hugging Face transformers:
every decode step of each family's model (Llama's, Gemma 3, GPT-2) after the first at a row
count replays the kernel calls the module forward made, and each generated token's logprob is
the HF model's for the same sequence; K and V swapped in the replayed calls are caught by the
same comparison; a torch operator outside the kernels refuses the tape (the module forward
runs). Steps it cannot take run the modules; its kernels (the KV-row write, silu * up,
attention on strided q) against the torch code they stand for."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import transformers

from kvpage import LLM, SamplingParams
from kvpage.model import decode_tape, load_model, native_attention, native_build, native_small_ops
from kvpage.model.decode_tape import DecodeTape, Tape
from kvpage.model.kernels import finalize
from kvpage.model.layers import SwiGLU

from .hf_models import VOCAB, save_hf

pytestmark = pytest.mark.skipif(
    native_build.compiler() is None or not native_build.enabled(), reason="needs a C++ compiler"
)
TOKENS = 20
# fp32 logprobs through the tape vs HF's full forward: the GEMV's and SDPA's summation orders
# (measured <= 2e-5 on these models; tests/model/test_hf_parity.py's STEP_ATOL).
ATOL = 1e-4
FAMILIES = ["llama-gqa-8q-2kv", "llama-tied", "qwen2-bias", "llama-mqa", "mistral-window",
            "qwen2-window", "qwen3", "phi3-partial-tied", "smollm3", "gemma3", "gpt2"]  # fmt: skip


def _prompts(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lengths = [1, 9, 23, *range(2, 2 + 2 * (n - 3), 2)][:n]
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in lengths]


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    """Per replayed step: its row count."""
    runs: list[int] = []
    replay = Tape.replay

    def counted(self):
        runs.append(self.x.shape[0])
        return replay(self)

    monkeypatch.setattr(Tape, "replay", counted)
    return runs


def _engine(directory, hook: bool = False, n: int = 3, **kw):
    llm = LLM(str(directory), num_blocks=128, seed=0, debug_checks=True, **kw)
    if hook:  # a forward hook on one MLP: the tape would skip it
        llm.engine.model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    try:
        outs = [o.outputs[0] for o in llm.generate(_prompts(n), params, use_tqdm=False)]
        tape = llm.engine.model.decode_plan()
    finally:
        llm.close()
    return [list(o.token_ids) for o in outs], [list(o.token_logprobs) for o in outs], tape


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


def _qwen3_head_dim_32(directory):
    """Qwen3 (q/k norms) at a head size the native paged decode takes (the family's is 24)."""
    cfg = save_hf("qwen3", directory).config
    cfg.head_dim = 32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3-head-dim-32"])
def test_every_decode_step_replays_the_tape_and_matches_hf(name, tmp_path, replays):
    save = _qwen3_head_dim_32 if name == "qwen3-head-dim-32" else lambda d: save_hf(name, d)
    hf_model = save(tmp_path)
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim not in native_attention.HEAD_DIMS:  # the module forward
        tokens, logprobs, tape = _engine(tmp_path, dtype="float32")
        assert replays == [] and tape.refused
        assert _hf_error(hf_model, tokens, logprobs) <= ATOL
        return
    tokens, logprobs, tape = _engine(tmp_path, dtype="float32")
    # Three prompts prefilled together, then decode-only steps of 3 rows to the end: the first
    # records, every other replays.
    assert replays == [3] * (TOKENS - 2) and not tape.refused
    assert all(t.program is not None for t in tape.recorded())  # one native call each
    err = _hf_error(hf_model, tokens, logprobs)
    assert err <= ATOL, f"{name}: logprob error {err:.3g} against HF on the decode tape"


def _torch_calls(tape: DecodeTape) -> list:
    return [fn for t in tape.recorded() for fn, _ in t.calls if not hasattr(fn, "argtypes")]


def test_rows_beyond_the_gemv_replay_the_torch_gemm_between_native_runs(tmp_path, replays):
    """24 sequences decoding together: float32 above the GEMV's row limit, so oneDNN's GEMM
    (a torch operator) runs: recorded as a call into a buffer and replayed from Python
    between the native runs."""
    hf_model = save_hf("qwen2-bias", tmp_path)
    tokens, logprobs, tape = _engine(tmp_path, n=24, dtype="float32")
    assert not tape.refused and replays.count(24) == TOKENS - 2
    assert _torch_calls(tape), "no torch GEMM was recorded: the rows ran a native kernel"
    err = _hf_error(hf_model, tokens, logprobs)
    assert err <= ATOL, f"logprob error {err:.3g} against HF at 24 rows"


def test_int8_rows_beyond_the_gemv_replay_the_widened_tiles_as_the_modules_run_them(
    tmp_path, replays, monkeypatch
):
    """int8 weights at 24 rows, the GEMV held to 8 (it takes int8 at every row count on
    AVX-512): the widened float32 tiles (torch's GEMM) between the native runs give the
    module forward's tokens and logprobs, bit for bit (the same kernels)."""
    monkeypatch.setenv("KVPAGE_GEMV_MAX_ROWS", "8")
    save_hf("qwen2-bias", tmp_path)
    taped = _engine(tmp_path, n=24, dtype="float32", quantization="int8")
    assert replays.count(24) == TOKENS - 2 and _torch_calls(taped[2])
    modules = _engine(tmp_path, n=24, dtype="float32", quantization="int8",
                      fast_paths_off=("decode_plan",))  # fmt: skip
    assert taped[:2] == modules[:2]


def test_a_torch_op_in_a_layer_refuses_the_tape(tmp_path, replays, monkeypatch):
    forward = SwiGLU.forward
    monkeypatch.setattr(SwiGLU, "forward", lambda self, x: forward(self, x) * 1.0)
    hf_model = save_hf("llama-gqa-8q-2kv", tmp_path)
    tokens, logprobs, tape = _engine(tmp_path, dtype="float32")
    assert replays == [] and "aten.mul.Tensor" in next(iter(tape.refused.values()))
    assert _hf_error(hf_model, tokens, logprobs) <= ATOL


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "python-loop"])
def test_k_and_v_swapped_in_the_replayed_calls_is_caught(one_call, tmp_path, monkeypatch):
    """The planted bug swaps K and V in the recorded KV writes (the recording step itself is
    the module forward's): replayed from the one native call, or from the Python loop."""
    write = native_attention.library().kvpage_paged_write
    compile_ = Tape.compile

    def swapped(self):
        self.calls = [(fn, (a[0], a[2], a[1], *a[3:]) if fn is write else a)
                      for fn, a in self.calls]  # fmt: skip
        if one_call:
            compile_(self)
        assert (self.program is not None) == one_call

    monkeypatch.setattr(Tape, "compile", swapped)
    hf_model = save_hf("llama-gqa-8q-2kv", tmp_path)
    tokens, logprobs, _ = _engine(tmp_path, dtype="float32")
    assert _hf_error(hf_model, tokens, logprobs) > 100 * ATOL


@pytest.mark.parametrize("name", ["llama-gqa-8q-2kv", "phi3-partial-tied", "gemma3", "gpt2"])
def test_the_python_loop_replays_as_the_one_call(name, tmp_path, replays, monkeypatch):
    save_hf(name, tmp_path)
    one_call = _engine(tmp_path, dtype="bfloat16")
    monkeypatch.setattr(Tape, "compile", lambda self: None)
    loop = _engine(tmp_path, dtype="bfloat16")
    assert one_call[:2] == loop[:2] and len(replays) == 2 * (TOKENS - 2)


@pytest.mark.parametrize("case", [{"kv_cache_dtype": "int8"}, {"hook": True}])
def test_steps_it_cannot_take_run_the_modules(case, tmp_path, replays):
    hf_model = save_hf("llama-gqa-8q-2kv", tmp_path)
    tokens, logprobs, _ = _engine(tmp_path, dtype="float32", **case)
    assert replays == []
    if "hook" in case:  # the modules' path is as right as the tape's
        assert _hf_error(hf_model, tokens, logprobs) <= ATOL


def test_the_tape_off_by_environment(tmp_path, monkeypatch, replays):
    monkeypatch.setenv("KVPAGE_DECODE_PLAN", "0")
    save_hf("llama-gqa-8q-2kv", tmp_path)
    _engine(tmp_path, dtype="float32")
    assert replays == []


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


def test_a_copy_of_the_model_builds_its_own_tape(tmp_path):
    """The reference's twins are deepcopies of the engine's model: a copy must not carry the
    original's tape (its modules, its recorded calls); finalized, it builds its own."""
    save_hf("llama-gqa-8q-2kv", tmp_path)
    model, _ = load_model(str(tmp_path))
    tape = model.decode_plan()
    twin = copy.deepcopy(model)
    assert isinstance(tape, DecodeTape) and twin.decode_plan() is None
    finalize(twin)
    assert twin.decode_plan() is not tape and twin.decode_plan().model is twin
    assert pickle.loads(pickle.dumps(model._plan)).plan is None


def test_row_counts_beyond_the_kept_tapes_are_recorded_again(tmp_path, replays, monkeypatch):
    """Sequences finishing one by one: 3, 2, then 1 rows, with one tape kept at a time; the
    tokens are the module forward's."""
    monkeypatch.setattr(decode_tape, "MAX_TAPES", 1)
    save_hf("llama-gqa-8q-2kv", tmp_path)

    def generate(**kw) -> list[list[int]]:
        llm = LLM(str(tmp_path), num_blocks=128, seed=0, dtype="float32", **kw)
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 9, 12)
        ]
        try:
            outs = llm.generate(_prompts(3), params, use_tqdm=False)
            tape = llm.engine.model.decode_plan()
            assert tape is None or len(tape.recorded()) == 1
        finally:
            llm.close()
        return [list(o.outputs[0].token_ids) for o in outs]

    assert generate() == generate(fast_paths_off=("decode_plan",))
    assert sorted(set(replays)) == [1, 2, 3]
