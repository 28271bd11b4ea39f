"""kvpage.model.kernels: a model finalized with one fast path off does not take it (its trap
stays silent) and the engine's tokens do not change; bound with every path on the engine takes
them; binding again turns a path back on."""

from __future__ import annotations

import pytest

import kvpage.model.native_small_ops as native_small_ops
from kvpage import LLM, SamplingParams
from kvpage.errors import InvalidConfig
from kvpage.model import load_model
from kvpage.model.decode_tape import DecodeTape
from kvpage.model.kernels import FAST_PATHS, TORCH, KernelChoice, bound_with, finalize, torch_twin
from kvpage.model.linear_kernels import LINEAR_KERNELS
from kvpage.model.native_amx import AmxLinear
from kvpage.model.native_attention import PagedDecode
from kvpage.model.native_gemv import WeightGemv

PROMPTS = [list(range(40, 60)), list(range(70, 75)), [9] * 3]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _count(monkeypatch, taken: list[str]) -> None:
    def counting(path, original):
        def call(*args, **kwargs):
            taken.append(path)
            return original(*args, **kwargs)

        return call

    for name in ("rms_norm", "rotary_", "silu_mul"):
        monkeypatch.setattr(
            native_small_ops, name, counting("small_ops", getattr(native_small_ops, name))
        )
    for kernel in LINEAR_KERNELS:  # onednn and widened: the linear kernels torch runs
        owner, name = kernel.counted
        if kernel.path in ("onednn", "widened"):
            monkeypatch.setattr(owner, name, counting(kernel.path, getattr(owner, name)))
    for cls, path in ((WeightGemv, "gemv"), (AmxLinear, "amx"), (PagedDecode, "paged_decode")):
        monkeypatch.setattr(cls, "__call__", counting(path, cls.__call__))
    monkeypatch.setattr(DecodeTape, "run", counting("decode_plan", DecodeTape.run))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_path_off_alone_is_not_taken(monkeypatch, dtype):
    llm = LLM("builtin:tiny-llama", dtype=dtype, max_num_seqs=4)
    taken: list[str] = []
    _count(monkeypatch, taken)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    on = set(taken)
    assert {"small_ops", "decode_plan"} <= on, on  # what runs on any CPU here
    model = llm.engine.model
    for path in FAST_PATHS:
        taken.clear()
        finalize(model, (path,))
        assert bound_with(model) == KernelChoice(frozenset({path}))
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert path not in taken, f"{path} taken while off"
        if path != "decode_plan":
            assert "decode_plan" not in taken  # the plan runs with every path on only
        else:
            assert "paged_decode" in taken  # the plan's attention kernel, called by the modules
        if dtype == "float32":
            assert got == expected, path
    taken.clear()
    finalize(model)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert {"small_ops", "decode_plan"} <= set(taken) <= on  # prefixes cached: less prefill


def test_the_engine_binds_its_config_paths_off(monkeypatch):
    """EngineConfig.fast_paths_off: the engine binds the model it is given without them."""
    llm = LLM("builtin:tiny-llama", fast_paths_off=("small_ops", "decode_plan"))
    taken: list[str] = []
    _count(monkeypatch, taken)
    llm.generate(PROMPTS, PARAMS)
    assert taken and not {"small_ops", "decode_plan"} & set(taken), set(taken)


def test_an_unknown_path_is_refused():
    with pytest.raises(InvalidConfig, match="unknown fast paths"):
        finalize(LLM("builtin:tiny-llama").engine.model, ("gemm",))
    with pytest.raises(InvalidConfig, match="unknown fast paths"):  # a typed error for a user
        LLM("builtin:tiny-llama", fast_paths_off=("gemm",))


def test_the_torch_twin_shares_the_weights_and_binds_torch_only():
    """The reference's model (kvpage.model.kernels.torch_twin): the very weight tensors, torch's
    operators only, kept while the model stays the same and made again when it changes."""
    model, _ = load_model("builtin:tiny-llama", "bfloat16")
    twin = torch_twin(model)
    assert bound_with(model).all_on and bound_with(twin) == TORCH
    assert model.decode_plan() is not None and twin.decode_plan() is None
    assert all(a is b for a, b in zip(twin.parameters(), model.parameters(), strict=True))
    assert not any(p.bands for p in _projections(twin)) and all(
        p.bands for p in _projections(model)
    )
    assert torch_twin(model) is twin
    model.model.layers[0].self_attn.window = 4  # a changed model: a new twin
    assert torch_twin(model) is not twin and torch_twin(model).model.layers[0].self_attn.window == 4


def _projections(model) -> list:
    return [v for m in model.modules() for v in vars(m).values() if hasattr(v, "bands")]
