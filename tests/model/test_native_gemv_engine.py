"""The weight GEMV kernel inside the engine: batch-1 decode and the LM head take it, and greedy
tokens are the same with it on and off (off: KVPAGE_GEMV_MAX_ROWS=0, the weight kernel alone, or
KVPAGE_NATIVE=0, every native kernel), in float32 activations, where the two paths differ by
accumulation-order rounding only (~1e-6 relative) and the built-in models' well-separated logits
leave no near-ties for that to flip. bfloat16 is checked against the float64 oracle in
test_native_gemv.py instead: there both paths round every layer's output to 8 bits, and a logit
tie broken differently is not a bug."""

from __future__ import annotations

import copy

import pytest
import torch

from kvpage import LLM, SamplingParams
from kvpage.model import native_attention, native_build, native_gemv
from kvpage.model.decode_tape import Tape
from kvpage.model.native_gemv import WeightGemv

# Skipped only without a compiler (or with native kernels switched off): a kernel that fails to
# build where a compiler exists fails these tests instead.
pytestmark = pytest.mark.skipif(
    native_build.compiler() is None or not native_build.enabled(), reason="needs a C++ compiler"
)

PROMPTS = ["The paged cache", "kvpage decodes one token at a time", "x"]


def _generate(model: str, quantization: str, dtype: str, seqs: int) -> list[list[int]]:
    llm = LLM(model, quantization=quantization, dtype=dtype, num_blocks=64, seed=0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:seqs]
    try:
        # One at a time: every decode step is batch 1 (the single-stream case the kernel is for).
        return [
            list(llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts
        ]
    finally:
        llm.close()


def _kernel_rows(monkeypatch) -> list[tuple[int, int]]:
    """(rows of x, outputs) of each kernel call: through a Projection, or made by the decode
    decode tape's replay (kvpage.model.decode_tape) from its recorded calls."""
    calls: list[tuple[int, int]] = []
    original, unchecked = WeightGemv.__call__, WeightGemv.run_unchecked

    def counting(self, x, out=None):
        calls.append((x.numel() // x.shape[-1], self.out_features))
        return original(self, x, out)

    def counting_unchecked(self, x, ldx, m, y, threads):
        calls.append((m, self.out_features))
        return unchecked(self, x, ldx, m, y, threads)

    def counting_replay(self):  # the tape's recorded calls: (plan, x, ldx, m, y, threads)
        gemv = native_gemv.library().kvpage_weight_gemv
        calls.extend((a[3], a[0].contents.out_features) for fn, a in self.calls if fn is gemv)
        return replay(self)

    replay = Tape.replay
    monkeypatch.setattr(WeightGemv, "__call__", counting)
    monkeypatch.setattr(WeightGemv, "run_unchecked", counting_unchecked)
    monkeypatch.setattr(Tape, "replay", counting_replay)
    return calls


@pytest.mark.parametrize("off", [{"KVPAGE_GEMV_MAX_ROWS": "0"}, {"KVPAGE_NATIVE": "0"}])
@pytest.mark.parametrize("model", ["builtin:tiny-llama", "builtin:tiny-qwen2", "builtin:tiny-gpt2"])
@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_float32_greedy_tokens_equal_with_the_kernel_on_and_off(
    model, quantization, off, monkeypatch
):
    calls = _kernel_rows(monkeypatch)
    on = _generate(model, quantization, "float32", seqs=3)
    assert any(rows == 1 for rows, _ in calls)  # batch-1 decode went through the kernel
    calls.clear()
    for key, value in off.items():
        monkeypatch.setenv(key, value)
    native_gemv._library.cache_clear()
    native_attention._library.cache_clear()
    try:
        reference = _generate(model, quantization, "float32", seqs=3)
    finally:
        for key in off:
            monkeypatch.delenv(key)
        native_gemv._library.cache_clear()
        native_attention._library.cache_clear()
    assert calls == []  # off means off
    assert on == reference
    assert all(len(t) == 12 for t in on)


def test_the_lm_head_takes_the_kernel_at_batch_1_in_bfloat16(monkeypatch):
    calls = _kernel_rows(monkeypatch)
    llm = LLM("builtin:tiny-llama", dtype="bfloat16", num_blocks=32, seed=0)
    vocab = llm.engine.model.config.vocab_size
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate("abc", params, use_tqdm=False)
    finally:
        llm.close()
    assert (1, vocab) in calls  # the head, on the one sampled row
    hidden = llm.engine.model.config.hidden_size
    assert any(rows == 1 and out != vocab and out != hidden for rows, out in calls)  # qkv / MLP


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_bfloat16_logits_with_the_kernel_are_as_close_to_float32_as_torchs(
    quantization, monkeypatch
):
    """bfloat16 end to end: the same model's logits with the kernel and with torch, each against
    the float32 forward of the same (bf16-representable) weights. Both round every layer to
    bfloat16, so neither is exact; the kernel must not be the worse of the two."""
    weight = torch.int8 if quantization == "int8" else torch.bfloat16
    limit = native_gemv.max_rows(torch.bfloat16, weight)  # 4 where oneDNN has AMX, else 16
    ids = [5, 17, 99, 3, 250, 42][:limit]  # within the bf16 kernel's row limit
    calls = _kernel_rows(monkeypatch)
    on = _forward("bfloat16", quantization, ids)
    assert calls, "the kernel did not run"
    monkeypatch.setenv("KVPAGE_GEMV_MAX_ROWS", "0")
    calls.clear()
    off = _forward("bfloat16", quantization, ids)
    assert calls == []
    monkeypatch.delenv("KVPAGE_GEMV_MAX_ROWS")
    exact = _forward("float32", "none", ids, upcast=quantization)
    err_on, err_off = (float((x - exact).abs().max()) for x in (on, off))
    scale = float(exact.abs().max())
    assert err_on <= 2 * err_off + 2.0**-8 * scale, (err_on, err_off, scale)


def _forward(dtype: str, quantization: str, ids: list[int], upcast: str = "none") -> torch.Tensor:
    """Logits (T, V) in float32 of builtin:tiny-llama's whole-sequence forward. `upcast`: the
    float32 twin of the bf16 model (its weights rounded to bfloat16, then int8 if "int8")."""
    from kvpage.model import load_model
    from kvpage.reference.weight_oracle import reference_model

    if upcast == "none" and dtype == "float32":
        model, _ = load_model("builtin:tiny-llama", torch.float32)
        return model.forward_full(ids).float()
    model, _ = load_model("builtin:tiny-llama", torch.bfloat16, quantization=quantization)
    if dtype == "bfloat16":
        return model.forward_full(ids).float()
    twin = reference_model(model)  # int8: dequantised linears; float: the model itself
    twin = copy.deepcopy(twin).float()
    return twin.forward_full(ids).float()
