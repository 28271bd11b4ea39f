"""Bugs in the engine's fast paths (kvpage.model.kernels.FAST_PATHS). The reference runs on
torch's kernels alone, so these show up as divergences; the gate's re-run with the fast paths
off names the path (kvpage.verify.kernel_attribution). Each is planted in the engine's own copy
of the model (`own_model`): the kernels' objects belong to the model, which the reference and
the other mutants' engines must keep unchanged."""

from __future__ import annotations

import ctypes

import torch

from kvpage.engine.engine import LLMEngine
from kvpage.verify.mutants.base import Mutant, bind, replace

SUITES = ("batching", "prefix")


def _projections(model) -> list:
    found = []
    for module in model.modules():
        found += [v for v in vars(module).values() if hasattr(v, "gemv_for")]
    return found


def _gemv_first_lane_unwritten(engine: LLMEngine) -> None:
    """The weight GEMV leaves the first output of each call unwritten (zero), as every Python
    caller runs it (Projection; the decode tape, which replays the kernel's calls without
    Python, is turned off on this engine so its decode steps run the modules)."""
    model = engine.model
    plan = model.decode_plan()
    if plan is not None:
        replace(plan, "on", False)
    for proj in _projections(model):
        with torch.inference_mode():
            kernel = proj.gemv_for(
                torch.zeros(1, proj.linears[0].weight.shape[-1], dtype=model.dtype)
            )
        if kernel is not None:
            bind(kernel, "run_unchecked", _first_lane_zeroed(kernel.run_unchecked))


def _first_lane_zeroed(original):
    def run_unchecked(self, x: int, ldx: int, m: int, y: int, threads: int) -> int:
        original(x, ldx, m, y, threads)
        ctypes.c_uint32.from_address(y).value = 0  # float32: 0.0 (a bfloat16 pair: 0, 0)
        return y

    return run_unchecked


def _plan_rope_swapped(engine: LLMEngine) -> None:
    """The decode tape takes the rotary tables as (sin, cos)."""
    plan = engine.model.decode_plan()
    if plan is None:
        return
    original = plan.run

    def run(self, x, rope, attn):
        cos, sin = rope
        return original(x, (sin, cos), attn)

    bind(plan, "run", run)


def _no_plan(cfg) -> str | None:
    if cfg.model_type != "llama":  # Gemma 3: two (cos, sin) pairs, GPT-2: none
        return "the decode tape takes no single (cos, sin) pair (not a Llama-family model)"
    return None


KERNEL_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "gemv_first_lane_unwritten",
        "the weight GEMV leaves the first output lane of each call unwritten",
        "kernel",
        _gemv_first_lane_unwritten,
        suites=SUITES,
        own_model=True,
    ),
    Mutant(
        "decode_plan_rope_swapped",
        "the decode plan hands the rotary tables over as (sin, cos)",
        "kernel",
        _plan_rope_swapped,
        suites=SUITES,
        own_model=True,
        not_applicable_on=_no_plan,
    ),
)
