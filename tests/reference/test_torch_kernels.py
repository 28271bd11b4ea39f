"""The reference binds torch's kernels only (issue 39.3): no module of kvpage.reference imports a
fast-path module, and a reference run with every fast path made to raise still runs, while an
engine run with the same patches hits them (so the patches are where the engine goes)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvpage.model.linear_kernels as linear_kernels
import kvpage.model.native_small_ops as native_small_ops
from kvpage import LLM, SamplingParams
from kvpage.model import load_model
from kvpage.model.decode_tape import DecodeTape
from kvpage.model.native_amx import AmxLinear
from kvpage.model.native_attention import PagedDecode
from kvpage.model.native_gemv import WeightGemv
from kvpage.reference.generator import generate, prompt_logprobs

REFERENCE = Path(__file__).resolve().parents[2] / "kvpage" / "reference"
# kvpage.model modules the reference may import: the model's base class, the kernel switch,
# the contiguous cache, building a model (a merged adapter's) and the int8 format's layer type.
ALLOWED_MODEL_MODULES = {"base", "kernels", "attention", "loader", "int8"}


def _imported_modules(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("path", sorted(REFERENCE.glob("*.py")), ids=lambda p: p.name)
def test_reference_imports_no_fast_path(path):
    tree = ast.parse(path.read_text())
    bad = set()
    for module in _imported_modules(tree):
        parts = module.split(".")
        model_module = parts[2] if parts[:2] == ["kvpage", "model"] and len(parts) > 2 else None
        # `from kvpage.model.base import CausalLM` lists kvpage.model.base.CausalLM too
        if model_module and model_module not in ALLOWED_MODEL_MODULES:
            bad.add(module)
        if parts[0] == "ctypes":
            bad.add(module)
    mkldnn = [
        n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "mkldnn"
    ]
    assert not bad, f"{path.name} imports fast-path modules {sorted(bad)}"
    assert not mkldnn, f"{path.name} calls oneDNN directly (lines {mkldnn})"


class FastPathTaken(AssertionError):
    pass


@pytest.fixture
def fast_paths_raise(monkeypatch):
    """Every fast path of kvpage.model raises when taken; `taken` lists what was tried."""
    taken: list[str] = []

    def trap(name):
        def raising(*args, **kwargs):
            taken.append(name)
            raise FastPathTaken(name)

        return raising

    for name in ("rms_norm", "rotary_", "silu_mul", "gelu_tanh_mul", "layer_norm", "gelu_new"):
        monkeypatch.setattr(native_small_ops, name, trap(name))
    monkeypatch.setattr(linear_kernels, "widened_linear", trap("widened_linear"))
    monkeypatch.setattr(linear_kernels, "onednn_linear", trap("onednn"))
    for cls in (WeightGemv, AmxLinear, PagedDecode, DecodeTape):
        attr = "run" if cls is DecodeTape else "__call__"
        monkeypatch.setattr(cls, attr, trap(cls.__name__))
    return taken


CONFIGS = [
    ("builtin:tiny-llama", "float32", "none"),
    ("builtin:tiny-llama", "bfloat16", "none"),
    ("builtin:tiny-qwen2", "bfloat16", "none"),
    ("builtin:tiny-gpt2", "float32", "none"),
    ("builtin:tiny-llama", "float32", "int8"),
    ("builtin:tiny-hybrid", "bfloat16", "int8"),
]


@pytest.mark.parametrize(("name", "dtype", "quantization"), CONFIGS)
def test_reference_runs_with_every_fast_path_raising(fast_paths_raise, name, dtype, quantization):
    model, _ = load_model(name, dtype, quantization=quantization)
    prompt = list(range(40, 75))
    out = generate(model, prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    rows = prompt_logprobs(model, prompt, 3)
    assert len(out.token_ids) == 6 and len(rows) == len(prompt)
    assert fast_paths_raise == []


@pytest.mark.parametrize(("name", "dtype", "quantization"), CONFIGS[:3])
def test_the_engine_takes_the_trapped_paths(fast_paths_raise, name, dtype, quantization):
    """The control: the same traps are on the engine's way, so the test above can fail."""
    llm = LLM(name, dtype=dtype, quantization=quantization)
    with pytest.raises(FastPathTaken):
        llm.generate([list(range(40, 75))], SamplingParams(max_tokens=4, ignore_eos=True))
    assert fast_paths_raise
