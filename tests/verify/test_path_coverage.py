"""Which fast paths the gate's honest engine took (kvpage.verify.path_coverage): counted while a
gate runs, restored after; the widened int8 tiles run only with the weight GEMV off on a CPU
whose GEMV takes every row count, which is what the matrix's off-gemv cell is for."""

from __future__ import annotations

from kvpage import LLM, SamplingParams
from kvpage.model.kernels import finalize
from kvpage.model.native_gemv import WeightGemv
from kvpage.verify import path_coverage
from kvpage.verify.gate import run_gate
from kvpage.verify.report import fast_path_lines

PROMPTS = [list(range(30, 70)), list(range(80, 90))]
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def test_counting_sees_the_paths_taken_and_restores_them():
    llm = LLM("builtin:tiny-qwen2", quantization="int8")
    before = WeightGemv.run_unchecked
    with path_coverage.counting() as counts:
        llm.generate(PROMPTS, PARAMS)
    assert WeightGemv.run_unchecked is before
    assert counts["gemv"] > 0
    finalize(llm.engine.model, ("gemv",))
    with path_coverage.counting() as off:
        llm.generate(PROMPTS, PARAMS)
    assert off["gemv"] == 0 and off["widened"] > 0 and off["decode_plan"] == 0


def test_the_gate_reports_every_path_with_its_calls():
    result = run_gate("builtin:tiny-llama", suites=("stop",), mutants=False, progress=False,
                      kv_cache_dtypes=(), paths_off=("decode_plan",))  # fmt: skip
    paths = result.to_dict()["fast_paths"]
    assert set(paths) >= {"gemv", "amx", "onednn", "widened", "small_ops", "decode_plan"}
    assert paths["decode_plan"]["calls"] == 0 and paths["small_ops"]["calls"] > 0
    assert result.environment["fast_paths_off"] == ["decode_plan"]
    lines = fast_path_lines(paths)
    assert any("decode_plan: on this machine, taken by NO case" in line for line in lines)
